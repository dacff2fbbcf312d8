"""A weight's 128x128-block FP8 operand and its transpose from one read, as one opaque kernel.

fp8-blockwise quantizes each weight in 128 x 128 blocks for fprop and reuses the values,
transposed, for dgrad. Written in plain PyTorch (kernels/operand.py) and compiled, that is five
kernels a weight in a 1.3B step: inductor splits the 16,384-element block maxima into two
reductions, then casts, and in backward casts again from the float32 weight to write the
transposed copy, with the transposed scales in a fifth (~23 us for a 2048 x 2048 weight). A
weight has no producer to fuse with (it is a leaf), so an opaque kernel loses nothing:
`weight_blocks` reads each block once and writes the values, their transpose and both scale
layouts (kernels/weight_blocks_triton.py; ~6 us there). The transposed values are then saved
for dgrad (1 byte a weight element, +1.2 GiB at 1.3B) instead of recomputed. A 1.3B step with
CUDA graphs ran 4.4 and 6.7 ms faster in the two orders of an A/B (1.117x and 1.120x bf16
against 1.087x and 1.099x; docs/hopper_sessions.md, session 91).

Same bits as `operand.quantize_operand(w, "e4m3", (128, 128), scale_format=...)` and its
transpose (tests/test_weight_blocks.py, on the GPU). Registered as kernels/weight_op.py
registers the weight ops: eager calls run a Library op, calls under torch.compile a `triton_op`;
without Triton or CUDA the op computes the same operands with kernels/operand.py.
"""

from __future__ import annotations

import torch

from minifloat.kernels import weight_op
from minifloat.kernels.operand import quantize_operand
from minifloat.kernels.weight_op import BLOCK

__all__ = ["supports", "weight_blocks"]

try:  # Triton ships with CUDA builds of torch; CPU machines have none.
    from minifloat.kernels.weight_blocks_triton import weight_blocks_2d as _triton_blocks
except ImportError:  # pragma: no cover - depends on the installation
    _triton_blocks = None


def _reference(w: torch.Tensor, inv: bool) -> tuple[torch.Tensor, ...]:
    """The operand and its transpose by kernels/operand.py (the definition)."""
    fmt = "inv" if inv else "fp32"
    values, scale = quantize_operand(w, "e4m3", (BLOCK, BLOCK), scale_format=fmt)
    return values, values.t().contiguous(), scale, scale.t().contiguous()


_op = weight_op.define(
    "weight_blocks", _triton_blocks, _reference,
    lambda rows, cols: [(rows // BLOCK, cols // BLOCK), (cols // BLOCK, rows // BLOCK)],
)  # fmt: skip


def supports(
    w: torch.Tensor, fmt: str, granularity: object, scale_format: str, rounding: str
) -> bool:
    """Whether `weight_blocks` takes this weight and operand spec: E4M3 in 128 x 128 blocks with
    "inv" or fp32 scales, rounded to nearest, of a 2-D CUDA float tensor whose dims are non-zero
    multiples of 128, on a machine with Triton (elsewhere the backends quantize as before)."""
    return (
        _triton_blocks is not None
        and fmt == "e4m3"
        and granularity == (BLOCK, BLOCK)
        and scale_format in ("inv", "fp32")
        and rounding == "nearest"
        and weight_op.fits(w)
    )


def weight_blocks(w: torch.Tensor, *, inv: bool) -> tuple[torch.Tensor, ...]:
    """(values [R, C], values transposed [C, R], scales [R/128, C/128], scales transposed) of
    `w` quantized to E4M3 in 128 x 128 blocks ("inv" or fp32 scales), without gradient."""
    return _op(w, inv)
