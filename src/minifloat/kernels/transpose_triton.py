"""A tiled 2-D transpose in Triton, the CUDA body of `kernels/transpose.py`'s op.

Each program loads a BLOCK_R x BLOCK_C tile row-major (coalesced, 16-byte vector loads) and
stores its transpose; Triton routes the tile through shared memory so that the stores are
coalesced too. Elements are moved as unsigned integers of their width, so any dtype works and
the copy is bit-exact. Importing this module needs Triton (CUDA builds of torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["transpose_2d", "TILES"]

# (BLOCK_R, BLOCK_C, num_warps) by element size in bytes: the best mean over the 1.3B / 7B
# operand shapes of benchmarks/transpose_bench.py on an H200 (82 % of copy bandwidth for FP8
# bytes, 79 % for bf16; benchmarks/results/transpose_h200_2026-11-23.md). 4 bytes: untuned.
TILES: dict[int, tuple[int, int, int]] = {1: (64, 128, 4), 2: (64, 128, 4), 4: (64, 64, 4)}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _transpose_kernel(
    src, dst, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):  # pragma: no cover - runs on the GPU
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    tile = tl.load(src + r[:, None].to(tl.int64) * cols + c[None, :], mask=mask)
    out_mask = (c[:, None] < cols) & (r[None, :] < rows)
    tl.store(dst + c[:, None].to(tl.int64) * rows + r[None, :], tl.trans(tile), mask=out_mask)


def transpose_2d(
    x: torch.Tensor, tile: tuple[int, int, int] | None = None
) -> torch.Tensor:  # pragma: no cover - runs on the GPU
    """x.t() contiguous, for a contiguous 2-D CUDA tensor; `tile` overrides `TILES`."""
    rows, cols = x.shape
    size = x.element_size()
    block_r, block_c, warps = tile or TILES.get(size, TILES[4])
    src = x.view(_BITS[size])
    out = torch.empty((cols, rows), dtype=src.dtype, device=x.device)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(cols, block_c))
    _transpose_kernel[grid](src, out, rows, cols, BLOCK_R=block_r, BLOCK_C=block_c,
                            num_warps=warps)  # fmt: skip
    return out.view(x.dtype)
