"""OCC's compensation in the quantized GEMMs of `QuantLinearFunction` (the math: occ.py).

With compensation format "e4m3":
    fprop: y += Q8(Δx)·Q8(w)ᵀ           [M,K]x[K,N]  one more FP8 GEMM, both operands E4M3 per row;
           with `OCCConfig.one_gemm` (the default; E2M1 row-scaled "inv" operands: fp4,
           fp4-occ) both products are one GEMM over 2K instead (`joins_products`):
           [x_q | Δx_q]·[w_q | w8]ᵀ [M,2K]x[2K,N], the remainder and the E4M3 weight on x_q's
           and w_q's own row scales over per-row factors (occ.joint_lhs, occ.joint_rhs), so
           that one bf16 output is written and no sum of partial products is read: 6-9 ms a
           1.3B step faster, y's SQNR within 0.06 dB (recipe_specs.OCCConfig;
           docs/hopper_sessions.md, session 66)
    wgrad: folded into the saved input when fprop's input is reused in wgrad (row or tensor
           scale): x_rhs = z = x_q + Δx·m_x in E4M3 (occ.fold_remainder), no extra GEMM;
           otherwise dw += Q8(dyᵀ)·Q8(Δxᵀ)ᵀ [N,M]x[M,K], both E4M3 per row along the tokens.
Otherwise (`occ.one_gemm=off`, or operands of other formats) fprop's two products are bf16
under bf16 autocast (`partial_dtype`), summed in float32.
With "fp32" (the reference): both corrections are dense fp32 GEMMs of Δx, saved in fp32, each an
opaque op (`fp32_mm`) so that eager and compiled code make the same BLAS call. The Δx saved for
wgrad is a `QOperand` with fmt "fp32" and a unit tensor scale (`remainder_wgrad_operand`), so
that it is stashed like the other operands; no `scaled_mm` takes it.
"""

from __future__ import annotations

import torch

from minifloat import formats, occ
from minifloat.kernels import Backend, QOperand
from minifloat.kernels.backend import fp32_scaled
from minifloat.recipe_specs import OCC_COMPENSATION_FORMATS
from minifloat.recipes import OperandSpec, QuantRecipe

__all__ = [
    "compensation",
    "folds_remainder",
    "recomputes_x_values",
    "joins_products",
    "joint_fprop",
    "fprop_correction",
    "partial_dtype",
    "folded_wgrad_operand",
    "remainder_wgrad_operand",
    "wgrad_correction",
    "fp32_mm",
]

_E4M3_ROWS = OperandSpec(fmt="e4m3", granularity="row")
Clip = tuple[torch.Tensor, torch.Tensor]

# The fp32 reference's GEMMs sum inexact products, in an order the BLAS picks by the operands'
# layouts (cuBLAS: its algorithm, split-K or not), and compiled code chooses layouts of its own:
# dyᵀ for wgrad went to cuBLAS transposed where eager's was row-major, 317 of 98,304 entries of
# dw other bits at 1024 tokens (H100), even through `.contiguous()`, which inductor may satisfy
# by a layout of its choice. Inductor also rewrites an fp32 `mm(a, b) + c` into
# `addmm(c, a, b)` (on the CPU always), whose BLAS sums c in with the products: y and dw other
# bits at contractions of 256 (session 84). An opaque op copies its operands row-major inside,
# where inductor does not reach, and is no mm to rewrite. Library-defined, as exact.py's ops.
_LIB = torch.library.Library("minifloat", "FRAGMENT")
_LIB.define("fp32_mm(Tensor a, Tensor b) -> Tensor")


def _fresh_fp32(t: torch.Tensor) -> torch.Tensor:
    """A new row-major float32 copy of t: the same layout and a fresh allocation's alignment
    whatever layout and offset t came in (cuBLAS may pick its algorithm by either)."""
    return torch.empty(t.shape, dtype=torch.float32, device=t.device).copy_(t)


def _fp32_mm_impl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    with torch.autocast(a.device.type, enabled=False):  # float32 under autocast too
        return torch.mm(_fresh_fp32(a), _fresh_fp32(b))


_LIB.impl("fp32_mm", _fp32_mm_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("minifloat::fp32_mm")
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "fp32_mm takes 2-D operands")
    torch._check(a.shape[1] == b.shape[0], lambda: "fp32_mm: contraction dims differ")
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.float32)


def fp32_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b [R, C] in float32 from fresh row-major float32 copies of a [R, J] and b [J, C]:
    the same BLAS call eager and compiled (the comment above says why), float32 under autocast
    too. No autograd: call it under no_grad or inside an autograd.Function's forward/backward
    (as QuantLinearFunction does)."""
    return torch.ops.minifloat.fp32_mm(a, b)


def _check_fmt(fmt: object) -> None:
    """A compensation format other than these was taken as "e4m3" silently."""
    if fmt not in OCC_COMPENSATION_FORMATS:
        valid = ", ".join(OCC_COMPENSATION_FORMATS)
        raise ValueError(f"compensation fmt must be one of {valid}, got {fmt!r}")


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


def recomputes_x_values(recipe: QuantRecipe) -> bool:
    """Whether OCC's joint operand and fold recompute x_q's values from x as its quantizer
    rounds them (`occ.clamped_grid_values`) instead of reading its E4M3 bytes back: an E2M1
    "inv" x_q, its scales from its own maxima, rounded to nearest."""
    lhs = recipe.fprop.lhs
    return (
        lhs.fmt == "e2m1"
        and lhs.scale_format == "inv"
        and lhs.rounding == "nearest"
        and not lhs.hadamard
        and lhs.granularity in ("row", "tensor")
        and recipe.delayed is None
    )


def joins_products(recipe: QuantRecipe) -> bool:
    """Whether fprop's two products run as one GEMM over [x_q | Δx_q] (`joint_fprop`):
    `OCCConfig.one_gemm` with E4M3 compensation of E2M1 "inv" row-scaled operands whose scales
    come from their own maxima. Its lhs is one whose values `joint_fprop` recomputes from x
    (`recomputes_x_values`), row-scaled."""
    rhs = recipe.fprop.rhs
    return (
        compensation(recipe) == "e4m3"
        and recipe.occ.one_gemm
        and recomputes_x_values(recipe)
        and recipe.fprop.lhs.granularity == "row"
        and rhs.fmt == "e2m1"
        and rhs.granularity == "row"
        and rhs.scale_format == "inv"
        and rhs.rounding == "nearest"
        and not rhs.hadamard
    )


def joint_fprop(
    backend: Backend,
    x: torch.Tensor,
    clip: Clip,
    x_q: QOperand,
    weight: torch.Tensor,
    w_q: QOperand,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    fast_accum: bool,
) -> torch.Tensor:
    """y = x_q·w_qᵀ + Δx_q·w8ᵀ (+ bias) [M, N] as one GEMM over 2K, both operands E4M3 per
    row (occ.joint_lhs, occ.joint_rhs); x_q and w_q "inv" operands (their multipliers given)."""
    # x_q's values recomputed from x (None), not read back from its E4M3 bytes: joins_products
    # admits only recipes that recomputes_x_values does
    lhs_values, lhs_scale = backend.kernel(occ.joint_lhs, x)(
        x.detach(), *clip, None, x_q.multiplier, x_q.scale
    )
    rhs_values, rhs_scale = backend.kernel(occ.joint_rhs, weight)(
        weight.detach(), w_q.data, w_q.multiplier, w_q.scale
    )
    lhs = fp32_scaled(lhs_values, lhs_scale, "e4m3", "row", False)
    rhs = fp32_scaled(rhs_values, rhs_scale, "e4m3", "row", False)
    return backend.scaled_mm(lhs, rhs, out_dtype=out_dtype, bias=bias, fast_accum=fast_accum)


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
    _check_fmt(fmt)
    if fmt == "fp32":
        return fp32_mm(occ.remainder(x, *clip), weight.t())
    delta_q = backend.quantize(x, _E4M3_ROWS, clip=clip, remainder=True)
    w_q = backend.quantize(weight, _E4M3_ROWS)
    return backend.scaled_mm(delta_q, w_q, out_dtype=out_dtype, fast_accum=fast_accum)


def folded_wgrad_operand(
    backend: Backend,
    x: torch.Tensor,
    clip: Clip,
    x_q: QOperand,
    unit_scale: bool,
    recompute_values: bool = False,
) -> QOperand:
    """wgrad's rhs [K, M] (a transposed view): z = x_q + Δx·m_x in E4M3 (occ.fold_remainder).

    Its scale is t (a power of two) when backward folds s_x into dy (`unit_scale`), else s_x·t
    (a tensor-scaled x_q: the product of a float32 and a power of two is exact).
    `recompute_values`: x_q's values recomputed from x (`recomputes_x_values`), not read back
    from its bytes."""
    values_max = formats.get(x_q.fmt).max
    values, t = backend.kernel(occ.fold_remainder, x)(
        x.detach(), *clip, None if recompute_values else x_q.data, x_q.scale, x_q.multiplier,
        values_max,
    )  # fmt: skip
    scale = t if unit_scale else x_q.scale * t
    return fp32_scaled(values.t(), scale, "e4m3", "tensor", True)


def remainder_wgrad_operand(backend: Backend, fmt: str, x: torch.Tensor, clip: Clip) -> QOperand:
    """Δxᵀ [K, M] (a transposed view) for the separate wgrad correction: E4M3 rows along the
    tokens ("e4m3"), or float32 ("fp32")."""
    _check_fmt(fmt)
    if fmt == "fp32":
        return _fp32_operand(occ.remainder(x, *clip).t(), transposed=True)
    return backend.quantize(x, _E4M3_ROWS, clip=clip, remainder=True, transpose=True)


def wgrad_correction(
    backend: Backend, fmt: str, dy: torch.Tensor, delta_rhs: QOperand
) -> torch.Tensor:
    """dyᵀ·Δx [N, K] in float32, `delta_rhs` from `remainder_wgrad_operand`."""
    _check_fmt(fmt)
    if fmt == "fp32":
        return fp32_mm(dy.t(), delta_rhs.values().t())
    dy_t = backend.quantize(dy, _E4M3_ROWS, transpose=True)
    return backend.scaled_mm(dy_t, delta_rhs, out_dtype=torch.float32)
