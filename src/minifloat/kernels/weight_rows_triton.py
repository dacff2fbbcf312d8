"""A weight's row-scaled E4M3 operands for fprop (w, a scale per row) and dgrad (wᵀ, a scale per
column of w) in two Triton kernels (and a memset), the CUDA body of kernels/weight_rows.py's op.

The first kernel takes each 128 x 128 block's row and column maxima (as integers,
`operand.abs_amax`: non-negative, so an integer maximum orders them) into the whole rows' and
columns' maxima by atomic maxima (order-independent: deterministic), after a memset of those.
In the second each program loads its block once with its 128 row and 128 column maxima, forms
both scales as `formats.inv_scales` ("inv") or `operand.scale_from_amax` (fp32) does
(kernels/weight_blocks_triton.py's `scaled_e4m3`), and stores the block cast row-scaled into
w's layout and column-scaled through wᵀ's addresses (no `tl.trans`: Triton 3.6 wrote wrong
bytes for `tl.trans` of FP8 values fresh from a cast, docs/hopper.md's rules; the compiler
converts the FP8 tile's layout for the store). Until session 94 the cast kernel loaded the
block a second time, transposed; reading it once with 4 warps rather than 8 took the op's
kernels from 47.7 to 36.2 us for a 5632 x 2048 float32 weight, 18.7 to 18.0 us for 2048 x
2048 (`weight_blocks_probe_1.3B_rows_s94{,b}_h200_2026-12-04.md`, profiler time, L2 flushed).
Importing this module needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minifloat.kernels.weight_blocks_triton import (
    block_tile,
    magnitude_bits,
    scaled_e4m3,
)
from minifloat.kernels.weight_op import BLOCK

__all__ = ["weight_rows_2d"]

# 4 warps a 128 x 128 block: 36.4-37.0 us for 1.3B's 46 MB weights against 8's 51.9-52.1 and
# 16's 59.0-59.7, and 18.0 against 20.4 and 22.7 for its 2048 x 2048 ones (session 94's probe,
# the cast kernel that reads each block once; the op's earlier kernels too at the 46 MB ones).
# The maxima kernel uses the same blocks and warps: of 23 other tilings (streaming bands among
# them) only 64 x 64 blocks at 2 warps were faster, 8.5 against 11.9 us at 2048 x 2048 and tied
# at larger weights, and not in a 1.3B fp8-rowwise step with CUDA graphs (session 96,
# `weight_maxima_probe_s96{,b}_...`, `train_interleaved_1.3B_ours_s96r{0,1}_...`).
NUM_WARPS = 4


@triton.jit
def _row_col_maxima_kernel(w, amax, rows, cols, BLOCK: tl.constexpr):  # pragma: no cover - GPU
    pr = tl.program_id(0)
    pc = tl.program_id(1)
    bits = magnitude_bits(block_tile(w, pr, pc, cols, BLOCK))
    r = pr * BLOCK + tl.arange(0, BLOCK)
    c = pc * BLOCK + tl.arange(0, BLOCK)
    # amax: [rows] row maxima, then [cols] column maxima, as non-negative int32 bits
    tl.atomic_max(amax + r, tl.max(bits, axis=1))
    tl.atomic_max(amax + rows + c, tl.max(bits, axis=0))


@triton.jit
def _rows_cast_kernel(
    w, amax, q, q_t, scale, mult, scale_t, mult_t, rows, cols,
    FMT_MAX: tl.constexpr, INV: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip  # pragma: no cover - runs on the GPU
    pr = tl.program_id(0)
    pc = tl.program_id(1)
    r = pr * BLOCK + tl.arange(0, BLOCK)
    c = pc * BLOCK + tl.arange(0, BLOCK)
    row_amax = tl.load(amax + r).to(tl.float32, bitcast=True)
    col_amax = tl.load(amax + rows + c).to(tl.float32, bitcast=True)
    v = block_tile(w, pr, pc, cols, BLOCK)
    # fprop's operand: the block row-scaled, in w's layout
    values, s, m = scaled_e4m3(v, row_amax[:, None], FMT_MAX, INV)
    tl.store(q + r[:, None].to(tl.int64) * cols + c[None, :], values)
    if pc == 0:
        tl.store(scale + r[:, None], s)
        tl.store(mult + r[:, None], m)
    # dgrad's: the same tile scaled by its column maxima, stored at wᵀ's addresses
    values_t, s_t, m_t = scaled_e4m3(v, col_amax[None, :], FMT_MAX, INV)
    tl.store(q_t + c[None, :].to(tl.int64) * rows + r[:, None], values_t)
    if pr == 0:
        tl.store(scale_t + c[None, :], s_t)
        tl.store(mult_t + c[None, :], m_t)


def weight_rows_2d(
    w: torch.Tensor, fmt_max: float, inv: bool, *, num_warps: int = NUM_WARPS, traced: bool = False
) -> tuple[torch.Tensor, ...]:  # pragma: no cover - runs on the GPU
    """(values [R, C] row-scaled, values of wᵀ [C, R] row-scaled (w's columns), scale [R, 1],
    multiplier [R, 1], scale of wᵀ [C, 1], its multiplier [C, 1]; "inv"'s m, the scale again for
    fp32 scales) of a contiguous 2-D CUDA tensor whose dims are multiples of 128, quantized to
    float8_e4m3fn. `traced`: launched through `torch.library.wrap_triton` (a `triton_op`)."""
    rows, cols = w.shape
    grid = (rows // BLOCK, cols // BLOCK)
    dev, f32, fp8 = w.device, torch.float32, torch.float8_e4m3fn
    amax = torch.zeros(rows + cols, dtype=torch.int32, device=dev)  # row, then column maxima
    q = torch.empty((rows, cols), dtype=fp8, device=dev)
    q_t = torch.empty((cols, rows), dtype=fp8, device=dev)
    scale, mult = (torch.empty((rows, 1), dtype=f32, device=dev) for _ in range(2))
    scale_t, mult_t = (torch.empty((cols, 1), dtype=f32, device=dev) for _ in range(2))
    outputs = (q, q_t, scale, mult, scale_t, mult_t)
    maxima, cast = _row_col_maxima_kernel, _rows_cast_kernel
    if traced:
        maxima, cast = map(torch.library.wrap_triton, (maxima, cast))
    maxima[grid](w, amax, rows, cols, BLOCK=BLOCK, num_warps=num_warps)
    cast[grid](
        w, amax, *outputs, rows, cols, FMT_MAX=fmt_max, INV=inv, BLOCK=BLOCK, num_warps=num_warps
    )
    return outputs
