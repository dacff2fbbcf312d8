"""A weight's tensor-scaled FP8 operand and its transpose from two reads, as one opaque op.

fp8-tensorwise quantizes each weight with one scale and reuses the values, transposed, for
dgrad. Compiled from kernels/operand.py, inductor takes the maximum in two reductions, casts,
and writes the transposed copy from another cast of the float32 weight: 10.5, 41 and 61 us for
1.3B's 2048 x 2048, 5632 x 2048 and 2048 x 5632 weights, against 8.7, 30 and 31 us for
kernels/weight_tensor_triton.py's two kernels (block maxima; then the scale and both layouts),
`weight_blocks_probe_1.3B_tensor_s92t_h200_2026-12-04.md`. As for kernels/weight_blocks.py, a
weight is a leaf with no producer to fuse with, so the opaque op loses nothing.

Same bits as `operand.quantize_operand(w, "e4m3", "tensor", scale_format=...)` and its
transpose (tests/test_weight_tensor.py). Registered as kernels/weight_op.py registers the
weight ops; without Triton or CUDA the op computes the same operands with kernels/operand.py.
"""

from __future__ import annotations

import torch

from minifloat.kernels import weight_op
from minifloat.kernels.operand import quantize_operand

__all__ = ["supports", "weight_tensor"]

try:  # Triton ships with CUDA builds of torch; CPU machines have none.
    from minifloat.kernels.weight_tensor_triton import weight_tensor_2d as _triton_tensor
except ImportError:  # pragma: no cover - depends on the installation
    _triton_tensor = None


def _reference(w: torch.Tensor, inv: bool) -> tuple[torch.Tensor, ...]:
    """The operand, its transpose, scale and multiplier by kernels/operand.py (the definition);
    the multiplier of fp32 scales is the scale again, as the kernel writes it."""
    fmt = "inv" if inv else "fp32"
    values, scale, m = quantize_operand(w, "e4m3", "tensor", scale_format=fmt, with_multiplier=True)
    return values, values.t().contiguous(), scale, scale.clone() if m is None else m


_op = weight_op.define(
    "weight_tensor", _triton_tensor, _reference, lambda rows, cols: [(1, 1), (1, 1)]
)


def supports(
    w: torch.Tensor, fmt: str, granularity: object, scale_format: str, rounding: str
) -> bool:
    """Whether `weight_tensor` takes this weight and operand spec: E4M3 with one "inv" or fp32
    scale, rounded to nearest, of a 2-D CUDA float tensor whose dims are non-zero multiples of
    128, on a machine with Triton (elsewhere the backends quantize as before)."""
    return (
        _triton_tensor is not None
        and fmt == "e4m3"
        and granularity == "tensor"
        and scale_format in ("inv", "fp32")
        and rounding == "nearest"
        and weight_op.fits(w)
    )


def weight_tensor(w: torch.Tensor, *, inv: bool) -> tuple[torch.Tensor, ...]:
    """(values [R, C], values transposed [C, R], scale [1, 1], multiplier [1, 1]: "inv"'s m, the
    scale again for fp32 scales) of `w` quantized to E4M3 with one scale, without gradient."""
    return _op(w, inv)
