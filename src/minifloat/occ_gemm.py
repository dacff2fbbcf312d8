"""OCC's compensation in the quantized GEMMs of `QuantLinearFunction` (the math: occ.py).

With compensation format "e4m3":
    fprop: y += Q8(Δx)·Q8(w)ᵀ           [M,K]x[K,N]  one more FP8 GEMM, both operands E4M3 per row
    wgrad: folded into the saved input when fprop's input is reused in wgrad (row or tensor
           scale): x_rhs = z = x_q + Δx/s_x in E4M3 (occ.fold_remainder), no extra GEMM;
           otherwise dw += Q8(dyᵀ)·Q8(Δxᵀ)ᵀ [N,M]x[M,K], both E4M3 per row along the tokens.
fprop's two products are bf16 under bf16 autocast (`partial_dtype`), summed in float32.
With "fp32" (the reference): both corrections are dense fp32 GEMMs of Δx, saved in fp32.
Operands in fp32 are `QOperand`s with fmt "fp32" and a unit tensor scale: every backend's
`scaled_mm` multiplies them in fp32 (no FP8 path takes them).
"""

from __future__ import annotations

import torch

from minifloat import formats, occ
from minifloat.kernels import Backend, QOperand
from minifloat.kernels.backend import fp32_scaled
from minifloat.recipes import OperandSpec, QuantRecipe

__all__ = [
    "compensation",
    "folds_remainder",
    "fprop_correction",
    "partial_dtype",
    "folded_wgrad_operand",
    "remainder_wgrad_operand",
    "wgrad_correction",
]

_E4M3_ROWS = OperandSpec(fmt="e4m3", granularity="row")
Clip = tuple[torch.Tensor, torch.Tensor]


def compensation(recipe: QuantRecipe) -> str | None:
    """The compensation format of `recipe`'s OCC ("e4m3", "fp32"), or None without one."""
    if recipe.occ is None or not recipe.occ.compensate:
        return None
    return recipe.occ.compensation_format


def folds_remainder(recipe: QuantRecipe) -> bool:
    """Whether wgrad takes OCC's remainder folded into its reused input operand."""
    return (
        compensation(recipe) == "e4m3"
        and recipe.wgrad.rhs.reuse
        and recipe.fprop.lhs.granularity in ("row", "tensor")
    )


def _fp32_operand(t: torch.Tensor, transposed: bool = False) -> QOperand:
    ones = torch.ones(1, 1, dtype=torch.float32, device=t.device)
    return fp32_scaled(t.float(), ones, "fp32", "tensor", transposed)


def partial_dtype(fmt: str | None, out_dtype: torch.dtype) -> torch.dtype:
    """The dtype of fprop's two partial products under compensation `fmt`: the layer's output
    dtype where that is bf16 and the compensation E4M3 (each partial rounded once, then their
    float32 sum rounded), else float32 (their exact float32 sum rounded once; always for the
    fp32 reference). Two bf16 partials halve the bytes the GEMMs write and their sum reads."""
    return torch.bfloat16 if fmt == "e4m3" and out_dtype == torch.bfloat16 else torch.float32


def fprop_correction(
    backend: Backend,
    fmt: str,
    x: torch.Tensor,
    clip: Clip,
    weight: torch.Tensor,
    fast_accum: bool,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Δx·wᵀ [M, N] in `out_dtype` (float32 for "fp32"), through an E4M3 GEMM ("e4m3") or in
    fp32 ("fp32")."""
    if fmt == "fp32":
        return backend.scaled_mm(
            _fp32_operand(occ.remainder(x, *clip)), _fp32_operand(weight), out_dtype=torch.float32
        )
    delta_q = backend.quantize(x, _E4M3_ROWS, clip=clip, remainder=True)
    w_q = backend.quantize(weight, _E4M3_ROWS)
    return backend.scaled_mm(delta_q, w_q, out_dtype=out_dtype, fast_accum=fast_accum)


def folded_wgrad_operand(
    backend: Backend, x: torch.Tensor, clip: Clip, x_q: QOperand, unit_scale: bool
) -> QOperand:
    """wgrad's rhs [K, M] (a transposed view): z = x_q + Δx/s_x in E4M3 (occ.fold_remainder).

    Its scale is t (a power of two) when backward folds s_x into dy (`unit_scale`), else s_x·t
    (a tensor-scaled x_q: the product of a float32 and a power of two is exact)."""
    values_max = formats.get(x_q.fmt).max
    values, t = backend.kernel(occ.fold_remainder, x)(
        x.detach(), *clip, x_q.data, x_q.scale, values_max
    )
    scale = t if unit_scale else x_q.scale * t
    return fp32_scaled(values.t(), scale, "e4m3", "tensor", True)


def remainder_wgrad_operand(backend: Backend, fmt: str, x: torch.Tensor, clip: Clip) -> QOperand:
    """Δxᵀ [K, M] (a transposed view) for the separate wgrad correction: E4M3 rows along the
    tokens ("e4m3"), or float32 ("fp32")."""
    if fmt == "fp32":
        return _fp32_operand(occ.remainder(x, *clip).t(), transposed=True)
    return backend.quantize(x, _E4M3_ROWS, clip=clip, remainder=True, transpose=True)


def wgrad_correction(
    backend: Backend, fmt: str, dy: torch.Tensor, delta_rhs: QOperand
) -> torch.Tensor:
    """dyᵀ·Δx [N, K] in float32, `delta_rhs` from `remainder_wgrad_operand`."""
    if fmt == "fp32":
        dy_t = _fp32_operand(dy.t())
    else:
        dy_t = backend.quantize(dy, _E4M3_ROWS, transpose=True)
    return backend.scaled_mm(dy_t, delta_rhs, out_dtype=torch.float32)
