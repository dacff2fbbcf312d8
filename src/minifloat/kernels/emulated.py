"""The reference backend: exact emulation of the quantized GEMMs in plain PyTorch, on any device.

Quantization is `minifloat.quantize` (float32 values on the grid, float32 scales). GEMMs with
tensor or row scales multiply the grid values in fp32 and apply the scales afterwards, in the
order torch's row-wise scaled GEMM uses on Hopper (`(acc * b_scaleᵀ) * a_scale`, measured);
block-scaled GEMMs multiply the
dequantized operands in fp32. On CUDA, keep TF32 matmuls off (the PyTorch default) or fp32 GEMMs
are not fp32.
"""

from __future__ import annotations

import torch

from minifloat import formats
from minifloat.dge import dge_derivative
from minifloat.kernels.backend import QOperand
from minifloat.occ import outliers, thresholds
from minifloat.quantize import quantize
from minifloat.recipes import DGEConfig, OCCConfig, OperandSpec

__all__ = ["EmulatedBackend"]

_ROWISH = ("tensor", "row")


class EmulatedBackend:
    """Reference implementation of the `Backend` protocol (see kernels/backend.py)."""

    name = "emulated"

    def quantize(
        self,
        x: torch.Tensor,
        spec: OperandSpec,
        *,
        prescale: torch.Tensor | None = None,
        transpose: bool = False,
        clip: tuple[torch.Tensor, torch.Tensor] | None = None,
        scale: torch.Tensor | None = None,
        transposed_copy: bool = False,  # a hint for fused backends; nothing to do here
    ) -> QOperand:
        xf = x.detach().float()
        if clip is not None:
            lo, hi = clip
            xf = torch.where(torch.isfinite(xf), torch.clamp(xf, lo, hi), xf)
        if prescale is not None:
            xf = xf * prescale.float()
        if transpose:
            xf = xf.t().contiguous()
        if scale is None:
            q = quantize(
                xf,
                spec.fmt,
                spec.granularity,
                scale_format=spec.scale_format,
                rounding=spec.rounding,
            )
            return QOperand(
                q.values, q.scale.reshape(_scale_shape(q.scale)), spec.fmt, spec.granularity
            )
        if spec.granularity != "tensor":
            raise ValueError("a given (delayed) scale needs tensor granularity")
        fmt = formats.get(spec.fmt)
        scale = scale.float().reshape(1, 1)
        values = fmt.round(xf / scale, rounding=spec.rounding)
        return QOperand(values, scale, spec.fmt, "tensor")

    def _transposed_data(self, q: QOperand) -> torch.Tensor:
        """q's values transposed and contiguous (backends may keep or copy them faster)."""
        return q.data.t().contiguous()

    def transpose(self, q: QOperand, *, unit_scale: bool = False) -> QOperand:
        data = self._transposed_data(q)
        if unit_scale:
            ones = torch.ones(1, 1, dtype=torch.float32, device=q.scale.device)
            return QOperand(data, ones, q.fmt, "tensor")
        if q.granularity == "tensor":
            return QOperand(data, q.scale, q.fmt, "tensor")
        if isinstance(q.granularity, tuple):
            br, bc = q.granularity
            return QOperand(data, q.scale.t().contiguous(), q.fmt, (bc, br))
        raise ValueError(f"cannot transpose a {q.granularity!r}-scaled operand keeping its scale")

    def scaled_mm(
        self,
        a: QOperand,
        b: QOperand,
        *,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if a.shape[1] != b.shape[1]:
            raise ValueError(f"contraction dims differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
        if a.granularity in _ROWISH and b.granularity in _ROWISH:
            acc = a.values() @ b.values().t()
            out = (acc * b.scale.t()) * a.scale
        else:
            out = a.dequantize() @ b.dequantize().t()
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)

    def apply_dge(
        self, dw: torch.Tensor, w_hp: torch.Tensor, w_q: QOperand, cfg: DGEConfig
    ) -> torch.Tensor:
        w_scaled = w_hp.detach().float() / w_q.expanded_scale()
        return dw.float() * dge_derivative(w_scaled, fmt=w_q.fmt, k=cfg.k, cap=cfg.cap)

    def occ_thresholds(self, x: torch.Tensor, cfg: OCCConfig) -> tuple[torch.Tensor, torch.Tensor]:
        return thresholds(x, cfg)

    def occ_outliers(
        self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return outliers(x, lo, hi)

    def hp_matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.float() @ b.float().t()


def _scale_shape(scale: torch.Tensor) -> torch.Size:
    """quantize() returns 2-D scales for 2-D data already; keep them 2-D."""
    return scale.shape if scale.dim() == 2 else torch.Size([1, 1])
