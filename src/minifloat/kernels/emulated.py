"""The reference backend: the quantized GEMMs emulated exactly in plain PyTorch, on any device.

Operands are quantized by `kernels/operand.py` (values stored in FP8 bytes, bit-identical to
`minifloat.quantize.quantize`), or by `quantize()` itself for formats and scale formats without
a fast path (values in float32). GEMMs with tensor or row scales multiply the grid values in
fp32 and apply the scales afterwards, in the order torch's row-wise scaled GEMM uses on Hopper
(`(acc * b_scaleᵀ) * a_scale`, measured); block-scaled GEMMs multiply the dequantized operands
in fp32. On CUDA, keep TF32 matmuls off (the PyTorch default) or fp32 GEMMs are not fp32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from minifloat import formats
from minifloat.dge import dge_scale
from minifloat.exact import div_rn, to_dtype
from minifloat.kernels import clip as occ_clip
from minifloat.kernels import microscale, operand
from minifloat.kernels.backend import QOperand, fp32_scaled
from minifloat.quantize import quantize
from minifloat.recipes import DGEConfig, OperandSpec

__all__ = ["EmulatedBackend"]

_ROWISH = ("tensor", "row")


class EmulatedBackend:
    """Reference implementation of the `Backend` protocol (see kernels/backend.py)."""

    name = "emulated"

    def kernel(self, fn: Callable, like: torch.Tensor) -> Callable:
        """`fn` (a plain PyTorch function of kernels/, dge.py or occ.py) as this backend runs it
        on `like`'s device: here as is; the Hopper backend runs a compiled twin for eager CUDA
        calls."""
        return fn

    def quantize(
        self,
        x: torch.Tensor,
        spec: OperandSpec,
        *,
        prescale: torch.Tensor | None = None,
        transpose: bool = False,
        clip: tuple[torch.Tensor, torch.Tensor] | None = None,
        remainder: bool = False,
        scale: torch.Tensor | None = None,
        seed: torch.Tensor | None = None,
    ) -> QOperand:
        if scale is not None and spec.granularity != "tensor":
            raise ValueError("a given (delayed) scale needs tensor granularity")
        if remainder and clip is None:
            raise ValueError("quantizing OCC's remainder needs its clip bounds")
        fast = operand.supports(spec.fmt, spec.granularity, spec.scale_format, spec.rounding)
        if remainder and not fast:  # the remainder itself, quantized as any operand
            x, clip = occ_clip.remainder(x.detach(), *clip), None
        if microscale.supports(spec):  # NVFP4 / MXFP4 blocks, SR, Hadamard transforms
            return microscale.quantize(
                self, x, spec, prescale=prescale, transpose=transpose, clip=clip, seed=seed
            )
        if fast:
            values, s, m = self.kernel(operand.quantize_operand, x)(
                x.detach(), spec.fmt, spec.granularity, clip=clip, remainder=remainder,
                prescale=prescale, transpose=transpose, scale=scale,
                scale_format=spec.scale_format, with_multiplier=True,
            )  # fmt: skip
            return fp32_scaled(values, s, spec.fmt, spec.granularity, transpose, m)
        return _reference_quantize(x, spec, prescale, transpose, clip, scale)

    def quantize_with_transpose(
        self, w: torch.Tensor, spec: OperandSpec
    ) -> tuple[QOperand, QOperand]:
        q = self.quantize(w, spec)
        return q, self.transpose(q)

    def quantize_weight_pair(
        self, w: torch.Tensor, fprop: OperandSpec, dgrad: OperandSpec
    ) -> tuple[QOperand, QOperand] | None:
        return None  # dgrad's operand quantized in backward, from the weight (not saved)

    def transpose(self, q: QOperand, *, unit_scale: bool = False) -> QOperand:
        data = q.data.t()  # a view: made contiguous by whatever needs it so (a GEMM, a save)
        flipped = not q.transposed
        if unit_scale:
            ones = torch.ones(1, 1, dtype=torch.float32, device=q.scale.device)
            return fp32_scaled(data, ones, q.fmt, "tensor", flipped)
        if q.granularity == "tensor":
            return fp32_scaled(data, q.scale, q.fmt, "tensor", flipped)
        if isinstance(q.granularity, tuple):
            br, bc = q.granularity
            return dataclasses.replace(
                q, data=data, scale=q.scale.t().contiguous(), granularity=(bc, br),
                transposed=flipped,
            )  # fmt: skip
        raise ValueError(f"cannot transpose a {q.granularity!r}-scaled operand keeping its scale")

    def scaled_mm(
        self,
        a: QOperand,
        b: QOperand,
        *,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None = None,
        fast_accum: bool = False,  # a hint for tensor cores; fp32 sums here
    ) -> torch.Tensor:
        _check_out_dtype(out_dtype)
        if a.shape[1] != b.shape[1]:
            raise ValueError(f"contraction dims differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
        if microscale.is_microscaled(a) or microscale.is_microscaled(b):
            return self.microscaled_mm(a, b, out_dtype=out_dtype, bias=bias)
        if a.granularity in _ROWISH and b.granularity in _ROWISH:
            acc = a.values() @ b.values().t()
            out = (acc * b.scale.t()) * a.scale
        else:
            out = a.dequantize() @ b.dequantize().t()
        if bias is not None:
            out = out + bias.float()
        return to_dtype(out, out_dtype)

    def microscaled_mm(
        self,
        a: QOperand,
        b: QOperand,
        *,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fp32 GEMM of the bf16-exact `values x block scale` operands (exact products, fp32
        sums), tensor scales on the output (kernels/microscale.py)."""
        _check_out_dtype(out_dtype)
        return microscale.dequantized_mm(a, b, out_dtype=out_dtype, bias=bias)

    def apply_dge(
        self, dw: torch.Tensor, w_hp: torch.Tensor, w_q: QOperand, cfg: DGEConfig
    ) -> torch.Tensor:
        scale = w_q.scale if w_q.granularity in _ROWISH else w_q.expanded_scale()
        return self.kernel(dge_scale, dw)(
            dw, w_hp, scale, fmt=w_q.fmt, cfg=cfg, w_mult=w_q.multiplier
        )


def _check_out_dtype(out_dtype: object) -> None:
    """An integer out_dtype truncated the product silently (a dtype check, no graph node)."""
    if not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
        raise TypeError(f"out_dtype must be a floating torch.dtype, got {out_dtype!r}")


def _reference_quantize(x, spec, prescale, transpose, clip, scale) -> QOperand:
    """`quantize()` for the specs `operand.quantize_operand` does not cover (float32 values)."""
    xf = x.detach().float()
    if clip is not None:
        xf = occ_clip.clamp(xf, *clip)
    if prescale is not None:
        xf = xf * prescale.float()
    if transpose:
        xf = xf.t().contiguous()
    if scale is not None:
        scale = scale.float().reshape(1, 1)
        values = formats.get(spec.fmt).round(div_rn(xf, scale), rounding=spec.rounding)
        return fp32_scaled(values, scale, spec.fmt, "tensor", False)
    q = quantize(
        xf, spec.fmt, spec.granularity, scale_format=spec.scale_format, rounding=spec.rounding
    )
    s = q.scale if q.scale.dim() == 2 else q.scale.reshape(1, 1)
    m = q.multiplier if spec.granularity in _ROWISH else None  # DGE's (QOperand.multiplier)
    m = m if m is None or m.dim() == 2 else m.reshape(1, 1)
    return fp32_scaled(q.values, s, spec.fmt, spec.granularity, False, m)
