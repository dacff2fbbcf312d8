"""A weight's row-scaled FP8 operands for fprop and for dgrad from two reads, as one opaque op.

fp8-rowwise quantizes a weight w [N, K] twice: for fprop with a scale per row of w (along K),
and for dgrad as wᵀ with a scale per row of wᵀ, a column of w (along N); the two casts differ,
so dgrad cannot reuse fprop's values. Compiled from kernels/operand.py, inductor takes the row
maxima and casts in forward, and in backward the column maxima in two reductions and casts
again from the float32 weight. `weight_rows` makes both operands together
(kernels/weight_rows_triton.py: row and column maxima from one read, then both casts), and the
dgrad operand is saved (1 byte a weight element) instead of made in backward. As for
kernels/weight_blocks.py, a weight is a leaf with no producer to fuse with, so an opaque op
loses nothing.

Same bits as `operand.quantize_operand(w, "e4m3", "row", ...)` and the same of `w` with
`transpose=True` (tests/test_weight_rows.py). Registered as kernels/weight_op.py registers the
weight ops; without Triton or CUDA the op computes the same operands with kernels/operand.py.
"""

from __future__ import annotations

import torch

from minifloat.kernels import weight_op
from minifloat.kernels.operand import quantize_operand
from minifloat.recipe_specs import OperandSpec

__all__ = ["supports", "weight_rows"]

try:  # Triton ships with CUDA builds of torch; CPU machines have none.
    from minifloat.kernels.weight_rows_triton import weight_rows_2d as _triton_rows
except ImportError:  # pragma: no cover - depends on the installation
    _triton_rows = None


def _reference(w: torch.Tensor, inv: bool) -> tuple[torch.Tensor, ...]:
    """Both operands, scales and multipliers by kernels/operand.py (the definition); the
    multipliers of fp32 scales are the scales again, as the kernel writes them."""
    fmt = "inv" if inv else "fp32"
    out = []
    for transpose in (False, True):
        values, scale, m = quantize_operand(
            w, "e4m3", "row", transpose=transpose, scale_format=fmt, with_multiplier=True
        )
        out += [values.contiguous(), scale, scale.clone() if m is None else m]
    values, scale, m, values_t, scale_t, m_t = out
    return values, values_t, scale, m, scale_t, m_t


_op = weight_op.define(
    "weight_rows", _triton_rows, _reference,
    lambda rows, cols: [(rows, 1), (rows, 1), (cols, 1), (cols, 1)],
)  # fmt: skip


def supports(w: torch.Tensor, fprop: OperandSpec, dgrad: OperandSpec) -> bool:
    """Whether `weight_rows` makes these two operand specs of `w`: fprop's
    and dgrad's both E4M3 row-scaled, rounded to nearest, with the same "inv" or fp32 scales,
    dgrad's quantized anew (not reusing fprop's values), of a 2-D CUDA float tensor whose dims
    are non-zero multiples of 128, on a machine with Triton."""
    return (
        _triton_rows is not None
        and not dgrad.reuse
        and all(
            spec.fmt == "e4m3"
            and spec.granularity == "row"
            and spec.rounding == "nearest"
            and not spec.hadamard
            and spec.scale_format == fprop.scale_format
            for spec in (fprop, dgrad)
        )
        and fprop.scale_format in ("inv", "fp32")
        and weight_op.fits(w)
    )


def weight_rows(w: torch.Tensor, *, inv: bool) -> tuple[torch.Tensor, ...]:
    """(values [R, C] with a scale per row, values of wᵀ [C, R] with a scale per row of wᵀ,
    scale [R, 1], multiplier [R, 1], scale of wᵀ [C, 1], its multiplier [C, 1]; "inv"'s m, the
    scale again for fp32 scales) of `w` quantized to E4M3, without gradient."""
    return _op(w, inv)
