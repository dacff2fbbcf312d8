"""A weight's tensor-scaled E4M3 operand and its transpose in two Triton kernels, the CUDA body
of kernels/weight_tensor.py's op (fp8-tensorwise's weights).

Inductor makes four kernels of a tensor-scaled weight's quantization in a 1.3B step (the maxima
in two reductions, the forward's cast, and in backward the cast again from the float32 weight,
written transposed: ~25 us for a 2048 x 2048 weight, session 63's profile). Here the first
kernel takes each 128 x 128 block's maximum magnitude (as integers, `operand.abs_amax`); the
second reads those partial maxima in every program, forms the tensor's scale as
`formats.inv_scales` ("inv") or `operand.scale_from_amax` (fp32) does, and casts its block into
both layouts, with kernels/weight_blocks_triton.py's helpers. Importing this module needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minifloat.kernels.weight_blocks_triton import (
    block_tile,
    magnitude_max,
    scaled_e4m3,
    store_both,
)
from minifloat.kernels.weight_op import BLOCK

__all__ = ["weight_tensor_2d"]


@triton.jit
def _block_maxima_kernel(w, partial, cols, BLOCK: tl.constexpr):  # pragma: no cover - GPU
    pr = tl.program_id(0)
    pc = tl.program_id(1)
    v = block_tile(w, pr, pc, cols, BLOCK)
    tl.store(partial + pr * tl.num_programs(1) + pc, magnitude_max(v))


@triton.jit
def _tensor_cast_kernel(
    w, partial, n_partial, q, q_t, scale, multiplier, rows, cols,
    FMT_MAX: tl.constexpr, INV: tl.constexpr, BLOCK: tl.constexpr, P: tl.constexpr,
):  # fmt: skip  # pragma: no cover - runs on the GPU
    p = tl.arange(0, P)
    maxima = tl.load(partial + p, mask=p < n_partial, other=0)
    amax = tl.max(maxima, axis=0).to(tl.float32, bitcast=True)
    pr = tl.program_id(0)
    pc = tl.program_id(1)
    v = block_tile(w, pr, pc, cols, BLOCK)
    values, s, m = scaled_e4m3(v, amax, FMT_MAX, INV)
    store_both(q, q_t, values, pr, pc, rows, cols, BLOCK)
    if (pr == 0) & (pc == 0):
        tl.store(scale, s)
        tl.store(multiplier, m)


def weight_tensor_2d(
    w: torch.Tensor, fmt_max: float, inv: bool, *, num_warps: int = 8, traced: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # pragma: no cover - GPU
    """(values [R, C], values transposed [C, R], scale [1, 1], multiplier [1, 1]: "inv"'s m, the
    scale again for fp32 scales) of a contiguous 2-D CUDA tensor whose dims are multiples of
    128, quantized to float8_e4m3fn with one scale for the tensor. `traced`: launched through
    `torch.library.wrap_triton` (the body of a `triton_op`)."""
    rows, cols = w.shape
    grid = (rows // BLOCK, cols // BLOCK)
    partial = torch.empty(grid[0] * grid[1], dtype=torch.int32, device=w.device)
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=w.device)
    q_t = torch.empty((cols, rows), dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((1, 1), dtype=torch.float32, device=w.device)
    multiplier = torch.empty((1, 1), dtype=torch.float32, device=w.device)
    maxima_kernel, cast_kernel = _block_maxima_kernel, _tensor_cast_kernel
    if traced:
        maxima_kernel, cast_kernel = map(torch.library.wrap_triton, (maxima_kernel, cast_kernel))
    maxima_kernel[grid](w, partial, cols, BLOCK=BLOCK, num_warps=num_warps)
    cast_kernel[grid](
        w, partial, partial.numel(), q, q_t, scale, multiplier, rows, cols,
        FMT_MAX=fmt_max, INV=inv, BLOCK=BLOCK, P=triton.next_power_of_2(partial.numel()),
        num_warps=num_warps,
    )  # fmt: skip
    return q, q_t, scale, multiplier
