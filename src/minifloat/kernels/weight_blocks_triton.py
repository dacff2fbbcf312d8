"""A weight's 128x128-block E4M3 quantization and its transpose in one Triton kernel, the CUDA
body of `kernels/weight_blocks.py`'s op.

Each program owns one block: it loads the block once, takes its maximum magnitude, forms the
block's scale exactly as `kernels/operand.py` does (float64 quotients rounded once to float32),
and stores the FP8 values twice, row-major ([rows, cols], fprop's operand) and transposed
([cols, rows], dgrad's), with the block's scale in both scale layouts. The transposed store
reads the block's FP8 tile back after a barrier and transposes that (`TRANSPOSE` = 2), as the
tiled transpose of kernels/transpose_triton.py does: `tl.trans` of the cast's own registers
wrote wrong bytes on an H200 with Triton 3.6 (a 128 x 128 weight in tests/test_weight_blocks.py,
docs/hopper_sessions.md, session 91). Importing this module needs Triton (CUDA builds of torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minifloat.kernels.transpose_triton import transpose_2d

__all__ = ["weight_blocks_2d", "NUM_WARPS", "TRANSPOSE"]

# Per 128 x 128 block: 8 and 16 warps within 0.5 us of each other at 1.3B's weight shapes, 4
# up to 1.4 us slower (`weight_blocks_probe_1.3B_s91b_h200_2026-12-04.md`).
NUM_WARPS = 8
# How the transposed values are written: 0 by kernels/transpose_triton.py's tiled transpose, a
# kernel of its own (+1.2-2.7 us a weight at 1.3B); 1 the cast's registers through `tl.trans`
# (wrong bytes at 128 x 128 on an H200 with Triton 3.6; others report corrupted transposed fp8
# tiles too: triton-lang/triton#11111, mlc-ai/pith-train#74); 2 the block's stored tile loaded
# back after a barrier and transposed, in the same kernel (the default; as fast as 1).
TRANSPOSE = 2


@triton.jit
def _weight_blocks_kernel(
    w, q, q_t, scale, scale_t, rows, cols,
    FMT_MAX: tl.constexpr, INV: tl.constexpr, BLOCK: tl.constexpr, TRANSPOSE: tl.constexpr,
):  # fmt: skip  # pragma: no cover - runs on the GPU
    pr = tl.program_id(0)
    pc = tl.program_id(1)
    r = pr * BLOCK + tl.arange(0, BLOCK)
    c = pc * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(w + r[:, None].to(tl.int64) * cols + c[None, :]).to(tl.float32)
    # operand.abs_amax: the maximum of |v|'s bits as integers (NaN above inf above finite)
    bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    amax = tl.max(tl.max(bits, axis=1), axis=0).to(tl.float32, bitcast=True)
    zero = (amax == 0).to(tl.float32)
    one64 = tl.full([], 1.0, tl.float64)
    fmt_max64 = tl.full([], FMT_MAX, tl.float64)
    if INV:
        # formats.inv_scales: m = div_rn(fmt_max, max(amax, fmt_max * 2^-126)), 1 for all-zero
        # blocks, NaN where amax is inf or NaN (a NaN amax passes the where, as through clamp)
        floor = tl.full([], FMT_MAX * 2.0**-126, tl.float32)
        clamped = tl.where(amax < floor, floor, amax)
        m = (fmt_max64 * (one64 / clamped.to(tl.float64))).to(tl.float32)
        m = m * (1.0 - zero) + zero + (amax - amax)
        s = (one64 / m.to(tl.float64)).to(tl.float32)
        values = (v * m).to(tl.float8e4nv)  # |v * m| <= fmt_max: no clamp (round_to_storage)
    else:
        # operand.scale_from_amax, then exact.div_rn_by_scale and round_to_storage's clamp
        tiny = tl.full([], 1, tl.int32).to(tl.float32, bitcast=True)  # 2^-149
        raw = (amax.to(tl.float64) * (one64 / fmt_max64)).to(tl.float32)
        raw = tl.where(raw < tiny, tiny, raw)
        s = raw + zero + (amax - amax)
        quotient = (v.to(tl.float64) * (one64 / s.to(tl.float64))).to(tl.float32)
        quotient = tl.where(quotient > FMT_MAX, FMT_MAX, quotient)
        quotient = tl.where(quotient < -FMT_MAX, -FMT_MAX, quotient)
        values = quotient.to(tl.float8e4nv)
    tl.store(q + r[:, None].to(tl.int64) * cols + c[None, :], values)
    if TRANSPOSE == 1:  # the cast's registers transposed (Triton 3.6: wrong bytes, see above)
        tl.store(q_t + c[:, None].to(tl.int64) * rows + r[None, :], tl.trans(values))
    elif TRANSPOSE == 2:  # the stored tile loaded back and transposed, as transpose_triton does
        tl.debug_barrier()  # the block's stores above are visible to all its threads
        tile = tl.load(q + r[:, None].to(tl.int64) * cols + c[None, :])
        tl.store(q_t + c[:, None].to(tl.int64) * rows + r[None, :], tl.trans(tile))
    tl.store(scale + pr * (cols // BLOCK) + pc, s)
    tl.store(scale_t + pc * (rows // BLOCK) + pr, s)


def weight_blocks_2d(
    w: torch.Tensor,
    fmt_max: float,
    inv: bool,
    *,
    block: int = 128,
    num_warps: int = NUM_WARPS,
    transpose: int = TRANSPOSE,
    traced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # pragma: no cover - GPU
    """(values [R, C], values transposed [C, R], scales [R/b, C/b], scales transposed) of a
    contiguous 2-D CUDA tensor whose dims are multiples of `block`, as float8_e4m3fn values.
    `traced`: launched through `torch.library.wrap_triton` (the body of a `triton_op`)."""
    rows, cols = w.shape
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=w.device)
    q_t = None if transpose == 0 else torch.empty((cols, rows), dtype=q.dtype, device=w.device)
    scale = torch.empty((rows // block, cols // block), dtype=torch.float32, device=w.device)
    scale_t = torch.empty((cols // block, rows // block), dtype=torch.float32, device=w.device)
    kernel = torch.library.wrap_triton(_weight_blocks_kernel) if traced else _weight_blocks_kernel
    kernel[(rows // block, cols // block)](
        w, q, q if q_t is None else q_t, scale, scale_t, rows, cols,
        FMT_MAX=fmt_max, INV=inv, BLOCK=block, TRANSPOSE=transpose, num_warps=num_warps,
    )  # fmt: skip
    if transpose == 0:  # the transposed values by the tiled transpose of kernels/transpose.py
        q_t = transpose_2d(q, traced=traced)
    return q, q_t, scale, scale_t
