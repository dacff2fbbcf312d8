"""Candidate cast kernels for fp8-rowwise's weight operands, timed against
kernels/weight_rows_triton.py's by `weight_blocks_probe.py --granularity rows`.

Why (docs/hopper_sessions.md, session 93): the op's two kernels take fp8-rowwise's weights at
55-76 % of copy bandwidth where fp8-tensorwise's two, which move the same bytes, take 79-91 %.
Its cast kernel reads each block twice, the second time transposed (column-scaled values for
wᵀ's layout, from L2) to keep a `tl.trans` away from FP8 values fresh from a cast (Triton 3.6
wrote wrong bytes for that, session 91). The candidates read the block once:

- "addr": both casts from the one tile; wᵀ's values stored through transposed addresses (no
  `tl.trans`: the compiler converts the FP8 tile's layout for the store);
- "trans32": the float32 tile `tl.trans`ed (loaded values, not a cast's), then cast
  column-scaled and stored row-major into wᵀ's layout.

Each runs after the op's own maxima kernel (atomic row and column maxima), casts fprop's
operand as the op does (`fprop_cast`) and writes what `weight_rows_2d` writes; the probe checks
the bytes, outputs poisoned first, so a variant with wrong bytes shows as such. A variant that
wins moves into kernels/weight_rows_triton.py.
Importing this module needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minifloat.kernels.weight_blocks_triton import scaled_e4m3
from minifloat.kernels.weight_op import BLOCK
from minifloat.kernels.weight_rows_triton import fprop_cast, row_col_maxima_kernel, rows_buffers

__all__ = ["VARIANTS", "weight_rows_variant"]

VARIANTS = {"addr": 0, "trans32": 1}


@triton.jit
def _cast_once_kernel(
    w, amax, q, q_t, scale, mult, scale_t, mult_t, rows, cols,
    FMT_MAX: tl.constexpr, INV: tl.constexpr, BLOCK: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip  # pragma: no cover - runs on the GPU or under TRITON_INTERPRET
    pr = tl.program_id(0)
    pc = tl.program_id(1)
    v, col_amax = fprop_cast(w, amax, q, scale, mult, pr, pc, rows, cols, FMT_MAX, INV, BLOCK)
    r = pr * BLOCK + tl.arange(0, BLOCK)
    c = pc * BLOCK + tl.arange(0, BLOCK)
    if MODE == 0:  # "addr": column-scaled in w's layout, stored at wᵀ's addresses
        values_t, s_t, m_t = scaled_e4m3(v, col_amax[None, :], FMT_MAX, INV)
        tl.store(q_t + c[None, :].to(tl.int64) * rows + r[:, None], values_t)
        if pr == 0:
            tl.store(scale_t + c[None, :], s_t)
            tl.store(mult_t + c[None, :], m_t)
    else:  # "trans32": the loaded float32 tile transposed, then cast
        values_t, s_t, m_t = scaled_e4m3(tl.trans(v), col_amax[:, None], FMT_MAX, INV)
        tl.store(q_t + c[:, None].to(tl.int64) * rows + r[None, :], values_t)
        if pr == 0:
            tl.store(scale_t + c[:, None], s_t)
            tl.store(mult_t + c[:, None], m_t)


def weight_rows_variant(
    w: torch.Tensor, fmt_max: float, inv: bool, *, variant: str, num_warps: int = 8
) -> tuple[torch.Tensor, ...]:  # pragma: no cover - runs on the GPU or under TRITON_INTERPRET
    """`weight_rows_2d`'s outputs (values, values of wᵀ, scale, multiplier, scale of wᵀ, its
    multiplier) with the cast kernel of `variant` (a key of VARIANTS)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    rows, cols = w.shape
    grid = (rows // BLOCK, cols // BLOCK)
    amax, *outputs = rows_buffers(w)
    row_col_maxima_kernel[grid](w, amax, rows, cols, BLOCK=BLOCK, num_warps=num_warps)
    _cast_once_kernel[grid](
        w, amax, *outputs, rows, cols,
        FMT_MAX=fmt_max, INV=inv, BLOCK=BLOCK, MODE=VARIANTS[variant], num_warps=num_warps,
    )  # fmt: skip
    return tuple(outputs)
