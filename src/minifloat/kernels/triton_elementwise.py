"""Fused element-wise Triton kernels of the backward and of OCC.

- `dge_scale(dw, w, w_scale, k, cap)`: dw * f'(w / w_scale) in one pass (DGE, minifloat.dge),
  for E2M1 weights with row scales. The same float32 steps as `dge.dge_derivative`: the
  enclosing grid interval [a, a + δ) of |x| (clamped to max; max itself in the last interval),
  t = clamp(2(|x| - a)/δ - 1, -1, 1) with correctly rounded division, (1/k)·|t|^(1/k - 1) via
  libdevice `pow` (CUDA's powf, what PyTorch's pow calls), capped, NaN kept.
- `outlier_columns(x, lo, hi)`: per column of x, does it hold a finite entry with
  x - clamp(x) != 0 (exactly the columns `occ.outliers` selects; non-finite entries are not
  outliers there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["dge_scale", "outlier_columns"]


@triton.jit
def _e2m1_interval(mag):
    """Left grid point a and width δ of E2M1's interval holding mag in [0, 6]."""
    delta = tl.where(mag < 2.0, 0.5, tl.where(mag < 4.0, 1.0, 2.0))
    inv_delta = tl.where(mag < 2.0, 2.0, tl.where(mag < 4.0, 1.0, 0.5))
    # floor(mag / δ) * δ: δ is a power of two, so mag * (1/δ) is exact; floor is round-half-even
    # corrected downwards.
    y = mag * inv_delta
    r = (y + 8388608.0) - 8388608.0
    r = tl.where(r > y, r - 1.0, r)
    a = r * delta
    a = tl.where(mag >= 6.0, 4.0, a)  # max belongs to the last interval [4, 6]
    delta = tl.where(mag >= 4.0, 2.0, delta)
    return a, delta


@triton.jit
def _dge_kernel(
    dw_ptr, w_ptr, s_ptr, out_ptr, R, C,
    INV_K: tl.constexpr, EXPONENT: tl.constexpr, CAP: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + rows, mask=rows < R, other=1.0)
    x = tl.math.div_rn(w, tl.broadcast_to(s[:, None], w.shape))
    mag = tl.abs(x)
    mag = tl.where(mag > 6.0, 6.0, mag)
    a, delta = _e2m1_interval(mag)
    t = tl.math.div_rn(2.0 * (mag - a), delta) - 1.0
    t = tl.where(t < -1.0, -1.0, tl.where(t > 1.0, 1.0, t))
    deriv = INV_K * libdevice.pow(tl.abs(t), tl.full(t.shape, EXPONENT, tl.float32))
    deriv = tl.where(deriv > CAP, CAP, deriv)
    deriv = tl.where(x != x, x, deriv)
    dw = tl.load(dw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, dw * deriv, mask=mask)


def dge_scale(
    dw: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, k: float, cap: float
) -> torch.Tensor:
    """dw * min((1/k)|t|^(1/k-1), cap) for E2M1 weights w [N, K] with row scales [N, 1]; fp32."""
    if dw.shape != w.shape or w.dim() != 2 or w_scale.numel() != w.shape[0]:
        raise ValueError("dge_scale needs dw and w of one 2-D shape and one scale per row")
    r, c = w.shape
    out = torch.empty((r, c), dtype=torch.float32, device=w.device)
    grid = (triton.cdiv(r, 16), triton.cdiv(c, 128))
    _dge_kernel[grid](
        dw.contiguous(), w.contiguous(), w_scale.float().reshape(-1).contiguous(), out, r, c,
        INV_K=float(torch.tensor(1.0 / k, dtype=torch.float32)),
        EXPONENT=float(torch.tensor(1.0 / k - 1.0, dtype=torch.float32)),
        CAP=float(torch.tensor(cap, dtype=torch.float32)),
        BLOCK_R=16, BLOCK_C=128, num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _outlier_cols_kernel(
    x_ptr, stride_xr, lo_ptr, hi_ptr, flag_ptr, R, C,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xr + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)  # fmt: skip
    lo = tl.load(lo_ptr)
    hi = tl.load(hi_ptr)
    finite = tl.abs(x) < float("inf")  # non-finite entries are not outliers (occ.outliers)
    xc = tl.where(x < lo, lo, x)
    xc = tl.where(xc > hi, hi, xc)
    out = finite & ((x - xc) != 0.0)
    hit = tl.max(tl.where(mask & out, 1, 0), axis=0)
    tl.atomic_max(flag_ptr + cols, hit, mask=(cols < C) & (hit > 0))


def outlier_columns(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """int32 flags [C]: 1 where column c of the 2-D x holds an entry clamp(., lo, hi) changes."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("outlier_columns needs a 2-D tensor with contiguous rows")
    r, c = x.shape
    flags = torch.zeros(c, dtype=torch.int32, device=x.device)
    grid = (triton.cdiv(r, 128), triton.cdiv(c, 128))
    _outlier_cols_kernel[grid](
        x, x.stride(0), lo.float().reshape(1), hi.float().reshape(1), flags, r, c,
        BLOCK_R=128, BLOCK_C=128, num_warps=8,
    )  # fmt: skip
    return flags
