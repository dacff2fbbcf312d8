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
transpose (tests/test_weight_blocks.py, on the GPU). Eager calls run a Library op (cheaper
host wrapper than a custom op, as kernels/transpose.py says), calls under torch.compile a
`triton_op` that inductor launches from its own code. Without Triton or CUDA the op computes
the same operands with kernels/operand.py.
"""

from __future__ import annotations

import torch

from minifloat import formats
from minifloat.kernels.operand import quantize_operand

__all__ = ["BLOCK", "check_shape", "fake_operands", "fits", "supports", "weight_blocks"]

try:  # Triton ships with CUDA builds of torch; CPU machines have none.
    from minifloat.kernels.weight_blocks_triton import weight_blocks_2d as _triton_blocks
except ImportError:  # pragma: no cover - depends on the installation
    _triton_blocks = None

BLOCK = 128
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_LIB = torch.library.Library("minifloat", "FRAGMENT")
_LIB.define("weight_blocks(Tensor w, bool inv) -> (Tensor, Tensor, Tensor, Tensor)")


def _reference(w: torch.Tensor, inv: bool) -> tuple[torch.Tensor, ...]:
    """The operand and its transpose by kernels/operand.py (the definition)."""
    fmt = "inv" if inv else "fp32"
    values, scale = quantize_operand(w, "e4m3", (BLOCK, BLOCK), scale_format=fmt)
    return values, values.t().contiguous(), scale, scale.t().contiguous()


def _weight_blocks(w: torch.Tensor, inv: bool) -> tuple[torch.Tensor, ...]:
    if w.is_cuda and _triton_blocks is not None:
        return _triton_blocks(w.contiguous(), formats.get("e4m3").max, inv)
    return _reference(w, inv)


_LIB.impl("weight_blocks", _weight_blocks, "CompositeExplicitAutograd")


def fake_operands(w: torch.Tensor, scale_shape: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """The shapes and dtypes of a weight op's outputs (values, values transposed, scale and the
    scale's transpose or multiplier) for torch.compile's fake tensors."""
    rows, cols = w.shape
    fp8, f32 = torch.float8_e4m3fn, torch.float32
    return (
        w.new_empty((rows, cols), dtype=fp8),
        w.new_empty((cols, rows), dtype=fp8),
        w.new_empty(scale_shape, dtype=f32),
        w.new_empty(scale_shape[::-1], dtype=f32),
    )


@torch.library.register_fake("minifloat::weight_blocks")
def _(w: torch.Tensor, inv: bool) -> tuple[torch.Tensor, ...]:
    return fake_operands(w, (w.shape[0] // BLOCK, w.shape[1] // BLOCK))


if _triton_blocks is not None:

    @torch.library.triton_op("minifloat::weight_blocks_traced", mutates_args=())
    def _weight_blocks_traced(
        w: torch.Tensor, inv: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # pragma: no cover - GPU
        return _triton_blocks(w.contiguous(), formats.get("e4m3").max, inv, traced=True)


def fits(w: torch.Tensor) -> bool:
    """Whether `w` is a 2-D CUDA float tensor whose dims are non-zero multiples of 128, the
    weights this module's kernel and kernels/weight_tensor.py's take."""
    return (
        w.is_cuda
        and w.dim() == 2
        and w.dtype in _DTYPES
        and w.numel() > 0
        and w.shape[0] % BLOCK == 0
        and w.shape[1] % BLOCK == 0
    )


def check_shape(w: torch.Tensor, op: str) -> None:
    """A one-line ValueError unless `w` is 2-D with dims non-zero multiples of 128."""
    if w.dim() != 2 or w.numel() == 0 or w.shape[0] % BLOCK or w.shape[1] % BLOCK:
        raise ValueError(f"{op} takes a 2-D tensor with dims non-zero multiples of {BLOCK}, "
                         f"got shape {tuple(w.shape)}")  # fmt: skip


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
        and fits(w)
    )


def weight_blocks(w: torch.Tensor, *, inv: bool) -> tuple[torch.Tensor, ...]:
    """(values [R, C], values transposed [C, R], scales [R/128, C/128], scales transposed) of
    `w` quantized to E4M3 in 128 x 128 blocks ("inv" or fp32 scales), without gradient."""
    check_shape(w, "weight_blocks")
    w = w.detach()
    if _triton_blocks is not None and w.is_cuda and torch.compiler.is_compiling():
        return torch.ops.minifloat.weight_blocks_traced.default(w, inv)  # pragma: no cover
    return torch.ops.minifloat.weight_blocks.default(w, inv)
