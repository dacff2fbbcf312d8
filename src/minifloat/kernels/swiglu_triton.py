"""The SwiGLU backward's tensor-scaled operands in two Triton kernels: the CUDA body of
`kernels/swiglu.py`'s op.

From bf16 g, u (the saved gate and up projections) and dh (the down projection's dgrad output),
[M, F], each kernel recomputes per tile, in float32,

    h = silu(g)·u,   dg = silu'(g)·u·dh,   du = silu(g)·dh

with the arithmetic inductor generates for ATen's `silu` and `silu_backward` (libdevice's exp,
two IEEE divisions, the products in the same order): the values the compiled composite
(`w2(silu(w1 x) * w3 x)` of three QuantLinears) computes, bit for bit (session 35's probe,
`benchmarks/swiglu_tensorwise_probe.py`).
1. `_maxima_kernel`: each tile's max |dg| and max |du| (integer maxima of the magnitudes' bits,
   so NaN wins, as in `torch.amax`).
2. `_cast_kernel`: h_qᵀ under h's scale from forward, dg_q and du_q under theirs, row-major and
   transposed (through shared memory): five FP8 operands from one read of g, u and dh.
Quotients are `exact.div_rn`'s: the float32 value times the float64 reciprocal of the scale,
rounded once; clamps keep NaN. Importing this module needs Triton (CUDA builds of torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["swiglu_backward_maxima", "swiglu_backward_cast", "TILES"]

# (BM, BN, num_warps) of the maxima and cast kernels: session 35's probe on an H200 at 1.3B
# and 7B widths (`swiglu_tensorwise_probe_s35c_h200_2026-11-26.md`).
TILES = {"maxima": (32, 128, 4), "cast": (64, 64, 4)}
_FP8 = {torch.float8_e4m3fn: (tl.float8e4nv, 448.0), torch.float8_e5m2: (tl.float8e5, 57344.0)}


@triton.jit
def _tile(M, N, BM: tl.constexpr, BN: tl.constexpr):  # pragma: no cover - runs on the GPU
    """(rows, cols, in-bounds mask, row-major offsets) of this program's tile of an [M, N]
    tensor on a (row blocks, column blocks) grid."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    return rows, cols, mask, rows[:, None].to(tl.int64) * N + cols[None, :]


@triton.jit
def _swiglu_aten(g_ptr, u_ptr, dh_ptr, offs, mask):  # pragma: no cover - runs on the GPU
    """(h, dg, du) in float32 from bf16 g, u, dh, as inductor computes ATen's `silu` and
    `silu_backward`: d = exp(-g) + 1 (libdevice), silu = g / d, sigmoid = 1 / d."""
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    d = libdevice.exp(-g) + 1.0
    silu = g / d
    sig = 1 / d
    dg = dh * u * sig * (g * (1.0 - sig) + 1.0)
    return silu * u, dg, dh * silu


@triton.jit
def _tile_max(v):  # pragma: no cover - runs on the GPU
    """max |v| over the tile as the maximum of the magnitudes' bits (for non-negative floats the
    integer order is the float order, and NaN's bits exceed inf's: NaN propagates)."""
    bits = tl.max(tl.max(v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1), axis=0)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _maxima_kernel(
    g_ptr, u_ptr, dh_ptr, part, M, N, BM: tl.constexpr, BN: tl.constexpr
):  # fmt: skip  # pragma: no cover - runs on the GPU
    _, _, mask, offs = _tile(M, N, BM, BN)
    _, dg, du = _swiglu_aten(g_ptr, u_ptr, dh_ptr, offs, mask)
    k = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)).to(tl.int64)
    tl.store(part + 2 * k, _tile_max(dg))
    tl.store(part + 2 * k + 1, _tile_max(du))


@triton.jit
def _cast(v, r_ptr, MAX: tl.constexpr):  # pragma: no cover - runs on the GPU
    """RN32(v · RN64(1/s)) (`exact.div_rn`), clamped to ±MAX keeping NaN."""
    q = (v.to(tl.float64) * tl.load(r_ptr)).to(tl.float32)
    q = tl.where((q > -MAX) | (q != q), q, -MAX)
    return tl.where((q < MAX) | (q != q), q, MAX)


@triton.jit
def _cast_kernel(
    g_ptr, u_ptr, dh_ptr, r_h, r_g, h_t, dg_q, du_q, dg_t, du_t, M, N,
    H_DTYPE: tl.constexpr, H_MAX: tl.constexpr, G_DTYPE: tl.constexpr, G_MAX: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip  # pragma: no cover - runs on the GPU
    rows, cols, mask, offs = _tile(M, N, BM, BN)
    h, dg, du = _swiglu_aten(g_ptr, u_ptr, dh_ptr, offs, mask)
    qh = _cast(h, r_h, H_MAX).to(H_DTYPE)
    qg = _cast(dg, r_g, G_MAX).to(G_DTYPE)
    qu = _cast(du, r_g + 1, G_MAX).to(G_DTYPE)
    tl.store(dg_q + offs, qg, mask=mask)
    tl.store(du_q + offs, qu, mask=mask)
    offs_t = cols[:, None].to(tl.int64) * M + rows[None, :]
    mask_t = (cols[:, None] < N) & (rows[None, :] < M)
    tl.store(h_t + offs_t, tl.trans(qh), mask=mask_t)
    tl.store(dg_t + offs_t, tl.trans(qg), mask=mask_t)
    tl.store(du_t + offs_t, tl.trans(qu), mask=mask_t)


def swiglu_backward_maxima(
    g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor
) -> torch.Tensor:  # pragma: no cover - runs on the GPU
    """[2] float32: max |dg| and max |du| of contiguous bf16 CUDA g, u, dh [M, F]."""
    m, n = g.shape
    bm, bn, warps = TILES["maxima"]
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    part = torch.empty(grid[0] * grid[1], 2, dtype=torch.float32, device=g.device)
    _maxima_kernel[grid](g, u, dh, part, m, n, BM=bm, BN=bn, num_warps=warps)
    return part.amax(0)


def swiglu_backward_cast(
    g: torch.Tensor,
    u: torch.Tensor,
    dh: torch.Tensor,
    r_h: torch.Tensor,
    r_g: torch.Tensor,
    h_dtype: torch.dtype,
    g_dtype: torch.dtype,
) -> tuple[torch.Tensor, ...]:  # pragma: no cover - runs on the GPU
    """(h_qᵀ [F, M], dg_q [M, F], dg_qᵀ, du_q, du_qᵀ) of contiguous bf16 CUDA g, u, dh [M, F];
    `r_h` [1] and `r_g` [2] (dg's, du's) hold the float64 reciprocals of the scales."""
    m, n = g.shape
    bm, bn, warps = TILES["cast"]
    (h_tl, h_max), (g_tl, g_max) = _FP8[h_dtype], _FP8[g_dtype]
    h_t = torch.empty((n, m), dtype=h_dtype, device=g.device)
    dg_q, du_q = (torch.empty((m, n), dtype=g_dtype, device=g.device) for _ in range(2))
    dg_t, du_t = (torch.empty((n, m), dtype=g_dtype, device=g.device) for _ in range(2))
    _cast_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        g, u, dh, r_h, r_g, h_t, dg_q, du_q, dg_t, du_t, m, n,
        H_DTYPE=h_tl, H_MAX=h_max, G_DTYPE=g_tl, G_MAX=g_max, BM=bm, BN=bn, num_warps=warps,
    )  # fmt: skip
    return h_t, dg_q, dg_t, du_q, du_t
