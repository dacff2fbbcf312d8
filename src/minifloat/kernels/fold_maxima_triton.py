"""The wgrad fold's column maxima in Triton, the CUDA body of `kernels/fold_maxima.py`'s op.

Each program reads a band of 256 rows by 64 columns of x in loads of 8 rows (inductor's own
tile size for this reduction), multiplies each row by its s (loaded once a row: inductor loads
s with an index that depends on the program's columns, one address an element of x), keeps an
elementwise running maximum of the magnitudes' bits, and reduces it across rows once at the
end into the [C] maxima by atomic maxima: bits of non-negative floats order as the floats do,
so any order gives the same maximum. Importing this module needs Triton (CUDA builds of torch).

The tiling is the fastest of twelve (`column_maxima_probe_s95b_h200_2026-12-04.md`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["BAND", "COLS", "fold_column_amax_2d"]

BAND, ROWS, COLS, NUM_WARPS = 256, 8, 64, 4


@triton.jit
def _fold_maxima_kernel(
    x_ptr, s_ptr, out_ptr, cols_total, BAND: tl.constexpr, ROWS: tl.constexpr,
    COLS: tl.constexpr,
):  # fmt: skip  # pragma: no cover - runs on the GPU
    band = tl.program_id(0)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    acc = tl.zeros([ROWS, COLS], dtype=tl.int32)  # magnitudes' bits: >= 0
    for r0 in tl.range(0, BAND, ROWS):
        rows = band * BAND + r0 + tl.arange(0, ROWS)
        offsets = rows[:, None].to(tl.int64) * cols_total + cols[None, :]
        v = tl.load(x_ptr + offsets, eviction_policy="evict_first").to(tl.float32)
        s = tl.load(s_ptr + rows)
        acc = tl.maximum(acc, (v * s[:, None]).to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    tl.atomic_max(out_ptr + cols, tl.max(acc, axis=0))


def fold_column_amax_2d(
    x: torch.Tensor, s: torch.Tensor, *, traced: bool = False
) -> torch.Tensor:  # pragma: no cover - runs on the GPU
    """max over rows of |x.float() * s|, [1, C] float32, for contiguous CUDA x [R, C] (R a
    multiple of `BAND`, C of `COLS`) and contiguous float32 s [R, 1]. `traced`: launched
    through `torch.library.wrap_triton` (the body of a `triton_op`)."""
    rows, cols = x.shape
    kernel = torch.library.wrap_triton(_fold_maxima_kernel) if traced else _fold_maxima_kernel
    bits = torch.zeros(1, cols, dtype=torch.int32, device=x.device)
    kernel[(rows // BAND, cols // COLS)](
        x, s, bits, cols, BAND=BAND, ROWS=ROWS, COLS=COLS, num_warps=NUM_WARPS
    )
    return bits.view(torch.float32)
