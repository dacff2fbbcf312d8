"""A weight's 128x128-block E4M3 quantization and its transpose in one Triton kernel, the CUDA
body of `kernels/weight_blocks.py`'s op.

Each program owns one block: it loads the block once, takes its maximum magnitude, forms the
block's scale exactly as `kernels/operand.py` does (float64 quotients rounded once to float32),
and stores the FP8 values twice, row-major ([rows, cols], fprop's operand) and transposed
([cols, rows], dgrad's), with the block's scale in both scale layouts. The transposed store
reads the block's FP8 tile back after a barrier and transposes that (`store_both`): `tl.trans`
of the cast's own registers wrote wrong bytes on an H200 with Triton 3.6 (session 91, where
the probe also timed a separate transpose kernel: 1.2-2.7 us a weight slower). The jitted
helpers serve kernels/weight_tensor_triton.py too. Importing this module needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["weight_blocks_2d", "block_tile", "magnitude_bits", "magnitude_max", "scaled_e4m3",
           "store_both", "NUM_WARPS"]  # fmt: skip

# Per 128 x 128 block: 8 and 16 warps within 0.5 us of each other at 1.3B's weight shapes, 4
# up to 1.4 us slower (`weight_blocks_probe_1.3B_s91b_h200_2026-12-04.md`).
NUM_WARPS = 8


@triton.jit
def block_tile(w, pr, pc, cols, BLOCK: tl.constexpr):  # pragma: no cover - runs on the GPU
    """Block (pr, pc) of row-major `w`, as float32."""
    r = pr * BLOCK + tl.arange(0, BLOCK)
    c = pc * BLOCK + tl.arange(0, BLOCK)
    return tl.load(w + r[:, None].to(tl.int64) * cols + c[None, :]).to(tl.float32)


@triton.jit
def magnitude_bits(v):  # pragma: no cover - runs on the GPU
    """operand.magnitude_bits of float32 `v`: |v|'s bits as int32, ordered as the magnitudes
    (NaN above inf above every finite value)."""
    return v.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def magnitude_max(v):  # pragma: no cover - runs on the GPU
    """operand.abs_amax of a 2-D float32 tile, as int32 bits."""
    return tl.max(tl.max(magnitude_bits(v), axis=1), axis=0)


@triton.jit
def scaled_e4m3(v, amax, FMT_MAX: tl.constexpr, INV: tl.constexpr):  # pragma: no cover - GPU
    """(E4M3 values, scale, multiplier) of float32 `v` whose group maximum is `amax`, as
    kernels/operand.py quantizes them: "inv" (`INV`) by `formats.inv_scales`' multiplier m,
    values v * m unclamped (|v * m| <= fmt_max, `round_to_storage`); fp32 by
    `operand.scale_from_amax` and `exact.div_rn`'s float64 quotient, clamped to ±fmt_max (the
    multiplier returned is the scale again)."""
    zero = (amax == 0).to(tl.float32)
    one64 = tl.full([], 1.0, tl.float64)
    fmt_max64 = tl.full([], FMT_MAX, tl.float64)
    if INV:
        # m = div_rn(fmt_max, max(amax, fmt_max * 2^-126)), 1 for all-zero groups, NaN where
        # amax is inf or NaN (a NaN amax passes the where, as through torch.clamp)
        floor = tl.full([], FMT_MAX * 2.0**-126, tl.float32)
        clamped = tl.where(amax < floor, floor, amax)
        m = (fmt_max64 * (one64 / clamped.to(tl.float64))).to(tl.float32)
        m = m * (1.0 - zero) + zero + (amax - amax)
        s = (one64 / m.to(tl.float64)).to(tl.float32)
        values = (v * m).to(tl.float8e4nv)
    else:
        tiny = tl.full([], 1, tl.int32).to(tl.float32, bitcast=True)  # 2^-149
        raw = (amax.to(tl.float64) * (one64 / fmt_max64)).to(tl.float32)
        raw = tl.where(raw < tiny, tiny, raw)
        s = raw + zero + (amax - amax)
        quotient = (v.to(tl.float64) * (one64 / s.to(tl.float64))).to(tl.float32)
        quotient = tl.where(quotient > FMT_MAX, FMT_MAX, quotient)
        quotient = tl.where(quotient < -FMT_MAX, -FMT_MAX, quotient)
        values = quotient.to(tl.float8e4nv)
        m = s
    return values, s, m


@triton.jit
def store_both(q, q_t, values, pr, pc, rows, cols, BLOCK: tl.constexpr):  # pragma: no cover
    """Store a block's E4M3 values row-major into `q` and transposed into `q_t`. The transposed
    store loads the stored tile back after a barrier and transposes that, as
    kernels/transpose_triton.py moves loaded bytes: `tl.trans` of the cast's own registers
    wrote wrong bytes (a 128 x 128 weight, H200, Triton 3.6; others report the same class of
    bug: triton-lang/triton#11111, mlc-ai/pith-train#74)."""
    r = pr * BLOCK + tl.arange(0, BLOCK)
    c = pc * BLOCK + tl.arange(0, BLOCK)
    offsets = r[:, None].to(tl.int64) * cols + c[None, :]
    tl.store(q + offsets, values)
    tl.debug_barrier()  # the block's stores above are visible to all its threads
    tile = tl.load(q + offsets)
    tl.store(q_t + c[:, None].to(tl.int64) * rows + r[None, :], tl.trans(tile))


@triton.jit
def _weight_blocks_kernel(
    w, q, q_t, scale, scale_t, rows, cols,
    FMT_MAX: tl.constexpr, INV: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip  # pragma: no cover - runs on the GPU
    pr = tl.program_id(0)
    pc = tl.program_id(1)
    v = block_tile(w, pr, pc, cols, BLOCK)
    amax = magnitude_max(v).to(tl.float32, bitcast=True)
    values, s, _ = scaled_e4m3(v, amax, FMT_MAX, INV)
    store_both(q, q_t, values, pr, pc, rows, cols, BLOCK)
    tl.store(scale + pr * (cols // BLOCK) + pc, s)
    tl.store(scale_t + pc * (rows // BLOCK) + pr, s)


def weight_blocks_2d(
    w: torch.Tensor,
    fmt_max: float,
    inv: bool,
    *,
    block: int = 128,
    num_warps: int = NUM_WARPS,
    traced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # pragma: no cover - GPU
    """(values [R, C], values transposed [C, R], scales [R/b, C/b], scales transposed) of a
    contiguous 2-D CUDA tensor whose dims are multiples of `block`, as float8_e4m3fn values.
    `traced`: launched through `torch.library.wrap_triton` (the body of a `triton_op`)."""
    rows, cols = w.shape
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=w.device)
    q_t = torch.empty((cols, rows), dtype=q.dtype, device=w.device)
    scale = torch.empty((rows // block, cols // block), dtype=torch.float32, device=w.device)
    scale_t = torch.empty((cols // block, rows // block), dtype=torch.float32, device=w.device)
    kernel = torch.library.wrap_triton(_weight_blocks_kernel) if traced else _weight_blocks_kernel
    kernel[(rows // block, cols // block)](
        w, q, q_t, scale, scale_t, rows, cols,
        FMT_MAX=fmt_max, INV=inv, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    return q, q_t, scale, scale_t
