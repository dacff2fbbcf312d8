"""The Hopper backend: Triton quantizers and FP8 tensor-core GEMMs, bit-exact with the emulation.

`HopperBackend` implements the `Backend` protocol (kernels/backend.py) for CUDA tensors on GPUs
with FP8 tensor cores. It subclasses `EmulatedBackend` and defers to it, per call, for whatever it
does not accelerate, so results never depend on which path ran:

- quantize: Triton kernels (kernels/triton_quant.py) for E2M1/E4M3/E5M2 (and other formats
  whose grid fits in E4M3) with fp32 scales, "nearest" rounding, and tensor, row, 1 x 2^n or
  2^n x 2^n block granularity; values are stored as float8 (E2M1 inside E4M3, exactly).
  Stochastic rounding, pow2/e8m0/e4m3 scale formats and CPU tensors go to the emulation (its
  torch.Generator stream cannot be reproduced by Philox; the Triton kernels' own seeded
  stochastic rounding is available in triton_quant for callers that need speed over
  cross-backend equality).
- scaled_mm: `torch._scaled_mm` (kernels/scaled_mm.py), tensor-wise / row-wise / (1x128,
  128x128) / (1x128, 1x128) scales. An output dim C that is not a multiple of 16 falls back to
  the emulated GEMM (fp32 matmul of the FP8 values) with a warning; a ragged contraction dim is
  zero-padded.
- apply_dge: one fused Triton pass for E2M1 weights with row scales.
- occ_outliers: a one-pass Triton column scan instead of materializing x - clamp(x).
- occ_thresholds and hp_matmul: the emulation's own PyTorch code (already on the GPU).

Extra keyword (a hint, ignored by the emulation): `quantize(..., transposed_copy=True)` writes the
transposed values in the same pass, so a later `transpose(q)` costs nothing.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from minifloat import formats
from minifloat.kernels import ops, triton_quant
from minifloat.kernels import scaled_mm as smm
from minifloat.kernels.backend import QOperand
from minifloat.kernels.emulated import EmulatedBackend
from minifloat.recipes import DGEConfig, OperandSpec

__all__ = ["HopperBackend", "HopperQOperand", "FallbackWarning"]

_ROWISH = ("tensor", "row")


class FallbackWarning(UserWarning):
    """A GEMM or quantization ran in the emulation because the fast path cannot take it."""


@dataclass(frozen=True)
class HopperQOperand(QOperand):
    """A QOperand that may carry its transposed values (written in the quantizer's pass)."""

    data_t: torch.Tensor | None = None


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def _kernel_mode(granularity) -> tuple[str, int, int] | None:
    """(mode, block_r, block_c) of the quantize op for a granularity, None if unsupported."""
    if granularity == "tensor":
        return "tensor", 0, 0
    if granularity == "row":
        return "row", 0, 0
    if isinstance(granularity, tuple):
        br, bc = granularity
        if br == 1 and _pow2(bc):
            return "row", 0, bc
        if _pow2(br) and _pow2(bc):
            return "block", br, bc
    return None


def _fast_quantizable(x: torch.Tensor, spec: OperandSpec) -> bool:
    if not (x.is_cuda and x.dim() == 2 and x.numel() > 0):
        return False
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if spec.scale_format != "fp32" or spec.rounding != "nearest":
        return False
    try:
        triton_quant.storage_dtype(formats.get(spec.fmt))
        triton_quant.fmt_constants(formats.get(spec.fmt))
    except ValueError:
        return False
    return _kernel_mode(spec.granularity) is not None


def _prescale_vectors(
    prescale: torch.Tensor | None, shape: torch.Size, transpose: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """Map a [R,1] / [1,C] prescale of x's layout to (row_mult, col_mult) of the kernel's view."""
    if prescale is None:
        return None, None
    r, c = shape
    if prescale.dim() != 2:
        return None
    if tuple(prescale.shape) == (r, 1) and r != 1:
        per_row = prescale.reshape(-1)
        return (None, per_row) if transpose else (per_row, None)
    if tuple(prescale.shape) == (1, c) and c != 1:
        per_col = prescale.reshape(-1)
        return (per_col, None) if transpose else (None, per_col)
    return None


class HopperBackend(EmulatedBackend):
    """FP8 tensor-core backend; bit-exact with `EmulatedBackend` (see the module docstring)."""

    name = "hopper"

    def quantize(
        self,
        x: torch.Tensor,
        spec: OperandSpec,
        *,
        prescale: torch.Tensor | None = None,
        transpose: bool = False,
        clip: tuple[torch.Tensor, torch.Tensor] | None = None,
        scale: torch.Tensor | None = None,
        transposed_copy: bool = False,
    ) -> QOperand:
        mults = _prescale_vectors(prescale, x.shape, transpose)
        if not _fast_quantizable(x, spec) or mults is None:
            return super().quantize(
                x, spec, prescale=prescale, transpose=transpose, clip=clip, scale=scale
            )
        if scale is not None and spec.granularity != "tensor":
            raise ValueError("a given (delayed) scale needs tensor granularity")
        mode, br, bc = _kernel_mode(spec.granularity)
        if mode == "block" and mults != (None, None):
            return super().quantize(
                x, spec, prescale=prescale, transpose=transpose, clip=clip, scale=scale
            )
        lo, hi = clip if clip is not None else (None, None)
        values, values_t, s = ops.quantize(
            x.detach(), spec.fmt, mode, br, bc, transpose, mults[0], mults[1], lo, hi,
            None if scale is None else scale.float().reshape(1, 1), transposed_copy,
        )  # fmt: skip
        if scale is not None:
            s = scale.float().reshape(1, 1)  # returned as given, like the emulation
        return HopperQOperand(
            values, s, spec.fmt, spec.granularity, values_t if transposed_copy else None
        )

    def _transposed_data(self, q: QOperand) -> torch.Tensor:
        data_t = getattr(q, "data_t", None)  # written by the quantizer when asked for
        if data_t is not None:
            return data_t
        if q.data.dtype in smm.FP8_DTYPES:
            # A byte copy: FP8 values move bit for bit, whatever the dtype's copy kernel does.
            return q.data.view(torch.uint8).t().contiguous().view(q.data.dtype)
        return super()._transposed_data(q)

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
        kind = _gemm_kind(a, b)
        if kind is None or not smm.supported(a.data, b.data):
            if a.data.is_cuda and kind is not None:
                warnings.warn(
                    f"minifloat: GEMM with output dims {a.shape[0]}x{b.shape[0]} (not multiples "
                    "of 16) runs in the emulation, not on FP8 tensor cores",
                    FallbackWarning,
                    stacklevel=2,
                )
            return super().scaled_mm(a, b, out_dtype=out_dtype, bias=bias)
        gemm_dtype = torch.float32 if bias is not None else out_dtype
        if kind == "rowish":
            out = smm.scaled_mm_rowish(a.data, a.scale, b.data, b.scale, out_dtype=gemm_dtype)
        else:
            out = smm.scaled_mm_blocks(
                a.data, a.scale, b.data, b.scale, b.granularity, out_dtype=gemm_dtype
            )
        if bias is not None:
            out = (out + bias.float()).to(out_dtype)
        return out

    def apply_dge(
        self, dw: torch.Tensor, w_hp: torch.Tensor, w_q: QOperand, cfg: DGEConfig
    ) -> torch.Tensor:
        if not (dw.is_cuda and w_q.fmt == "e2m1" and w_q.granularity == "row" and dw.dim() == 2):
            return super().apply_dge(dw, w_hp, w_q, cfg)
        return ops.dge_scale(dw, w_hp.detach(), w_q.scale, float(cfg.k), float(cfg.cap))

    def occ_outliers(
        self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not (x.is_cuda and x.dim() == 2):
            return super().occ_outliers(x, lo, hi)
        flags = ops.outlier_columns(x.detach(), lo, hi)
        cols = torch.nonzero(flags).flatten()
        xs = x.detach()[:, cols].float()
        finite = torch.isfinite(xs)
        clamped = torch.where(finite, torch.clamp(xs, lo, hi), xs)
        return cols, torch.where(finite, xs - clamped, torch.zeros_like(xs)).contiguous()


def _gemm_kind(a: QOperand, b: QOperand) -> str | None:
    """GEMM kind: "rowish" (tensor/row scales), "blocks" (1x128 lhs), or None (emulate)."""
    if a.data.dtype not in smm.FP8_DTYPES or b.data.dtype not in smm.FP8_DTYPES:
        return None
    if a.data.dtype == b.data.dtype == torch.float8_e5m2:
        return None  # no E5M2 x E5M2 tensor-core GEMM
    if a.granularity in _ROWISH and b.granularity in _ROWISH:
        return "rowish"
    if a.granularity == (1, 128) and b.granularity in ((128, 128), (1, 128)):
        return "blocks"
    return None
