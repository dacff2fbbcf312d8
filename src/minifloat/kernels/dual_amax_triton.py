"""Both group maxima of a bf16 tensor in one read, in Triton: the CUDA body of
`kernels/dual_amax.py`'s op.

Each program loads one BLOCK_R x BLOCK_C tile, takes the magnitude bits of its values
(`operand.magnitude_bits`: the sign cleared; as integers they order as the magnitudes do, NaN
above inf) and stores the tile's row maxima and column maxima as partials: [C / BLOCK_C, R] and
[R / BLOCK_R, C] int16. The caller finishes both with an integer maximum over the partials.
Integer maxima are exact and order-independent, so the result equals inductor's two reductions
bit for bit. Importing this module needs Triton (CUDA builds of torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["row_column_partials", "TILE"]

# (BLOCK_R, BLOCK_C, num_warps): the fastest of six tiles on an H200 at 16384 x 2048, 4096 and
# 5632 and 32768 x 768 (benchmarks/dual_amax_probe.py, `dual_amax_probe_s64_tile_*`): 0.034
# against inductor's 0.048 ms at 16384 x 2048, 0.064 against 0.170 at 16384 x 5632.
TILE: tuple[int, int, int] = (128, 64, 4)


@triton.jit
def _partials_kernel(
    x, rowp, colp, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):  # pragma: no cover - runs on the GPU
    pr, pc = tl.program_id(0), tl.program_id(1)
    r = pr * BLOCK_R + tl.arange(0, BLOCK_R)
    c = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (r < R)[:, None] & (c < C)[None, :]
    v = tl.load(x + r[:, None].to(tl.int64) * C + c[None, :], mask=m, other=0.0)
    bits = v.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF  # magnitude bits, >= 0
    tl.store(rowp + pc * R + r, tl.max(bits, axis=1).to(tl.int16), mask=r < R)
    tl.store(colp + pr * C + c, tl.max(bits, axis=0).to(tl.int16), mask=c < C)


def row_column_partials(
    x: torch.Tensor, tile: tuple[int, int, int] | None = None, *, traced: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover - runs on the GPU
    """(row partials [ceil(C/BLOCK_C), R], column partials [ceil(R/BLOCK_R), C]) int16 magnitude
    bits of a contiguous 2-D bf16 CUDA tensor; `tile` overrides `TILE`. `traced`: launched
    through `torch.library.wrap_triton`, the body of a `triton_op`."""
    rows, cols = x.shape
    block_r, block_c, warps = tile or TILE
    grid = (triton.cdiv(rows, block_r), triton.cdiv(cols, block_c))
    rowp = torch.empty((grid[1], rows), dtype=torch.int16, device=x.device)
    colp = torch.empty((grid[0], cols), dtype=torch.int16, device=x.device)
    kernel = torch.library.wrap_triton(_partials_kernel) if traced else _partials_kernel
    kernel[grid](x, rowp, colp, rows, cols, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return rowp, colp
