"""OCC's clamp and remainder of an operand, and their row maxima taken from the operand's own.

x_c = clamp(x, lo, hi) and Δx = x - x_c (minifloat/occ.py has the method) are both monotone
non-decreasing functions of each entry, and rounding is monotone too. So over a row of finite
entries

    max |x_c| = max(|clamp(max x)|, |clamp(min x)|)
    max |Δx|  = max(|Δ(max x)|, |Δ(min x)|)

exactly, for any bounds lo <= hi: two reductions of x give both. The quantizers of x_c and Δx
take their row scales from these (`clamped_row_amax`, `remainder_row_amax`) rather than from a
pass over x_c and Δx. Compiled, the difference is in what inductor writes: x_c and Δx read x's
own inputs (a norm's: the block input, its rstd and weight) plus lo and hi, five buffers, and
inductor stores a value read by two kernels (its row maxima, then its cast) once it reads more
than four. With the maxima taken from x, the casts are x_c's and Δx's only readers and the two
float32 tensors are not written (docs/hopper_sessions.md, session 34).

Non-finite entries: the clamp passes them through, so a NaN or ±inf in a row gives that row's
max |x_c| as NaN or inf, as a pass over x_c does, and the remainder is 0 there. Such a row's
max |Δx| is then whatever the formula gives (0 where both extrema are non-finite): its x_c
scale is NaN, which makes every output the row reaches NaN (the row of y, and all of dw), so no
result depends on it. Taking the remainder's extrema over the finite entries instead, as until
session 51, cost two more reductions in the same kernel: 0.108 ms against 0.051 ms with two, for
x of 16384 x 4096 on an H200 (docs/hopper_sessions.md, session 51).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minifloat.partition_hints import finite

__all__ = [
    "clamp",
    "remainder",
    "row_reduce",
    "one_stage",
    "clamped_row_amax",
    "remainder_row_amax",
]


def clamp(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """x clamped to [lo, hi] in float32; non-finite entries pass through unchanged."""
    xf = x.float()
    return torch.where(finite(xf), _bounded(xf, lo, hi), xf)


def _bounded(xf: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """`torch.clamp(xf, lo, hi)` for finite float32 xf and OCC's bounds (a sorted sample's
    quantiles: lo <= hi, and lo NaN only with hi NaN, since NaN sorts last), as two
    compare-selects: eager ATen's values bit for bit, NaN everywhere where hi is NaN.

    Not torch.clamp (docs/hopper_sessions.md, session 58):
    - Compiled, inductor takes max(-0.0, +0.0) as +0.0 (CPU and Triton code alike) where
      eager ATen keeps -0.0, so a bound of exactly ±0 made compiled differ from eager in the
      sign of zeros. A select keeps x's own zero in every form.
    - Inductor's Triton code writes each clamp bound as a NaN-propagating compare and select,
      four instructions an element, in kernels bound by their instructions on an H200.
    Each comparison is of the difference with a literal 0: the sign of a rounded difference of
    finite floats is exact, so `x - hi <= 0` is `x <= hi`. Compared with the [1, 1] bound
    itself, the comparison reads more than four times the bytes it writes, which the
    partitioner counts as a reduction it will not recompute, and the compiled fp4 block saved
    its wgrad operand z again (partition_hints.py, 1).
    """
    return torch.where((xf - hi) <= 0.0, torch.where((xf - lo) >= 0.0, xf, lo), hi)


def remainder(
    x: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    multiplier: torch.Tensor | None = None,
) -> torch.Tensor:
    """Δx = x - clamp(x, lo, hi) in float32 (dense, x's shape); 0 at non-finite entries, which
    stay in the clamped part and propagate through its quantization. With a float32
    `multiplier` m (broadcast: [R, 1] or [1, 1]), Δx·m, the product rounded once, and the same 0
    at non-finite entries (not 0·m).

    The 0 is `lo - lo`, a zero of this call's own rather than a graph constant shared by every
    layer (partition_hints.py, 3). It is NaN only where lo is not finite (a sample without
    finite entries), and then the clamped part, so every output of the layer, is NaN already.

    The product is taken inside the select, for callers that add to it (occ.fold_remainder):
    compiled Triton contracts a float32 product whose result feeds an addition into a fused
    multiply-add, rounded once where eager rounds twice. Behind the select the addition's
    operand is no product, so nothing contracts and compiled equals eager: on inputs crafted
    so that a contraction changes every clipped entry's E4M3 byte, the plain product then sum
    compiled on an H200 was off in all of them, this form in none (tests/test_occ.py;
    docs/hopper_sessions.md, sessions 72 and 76)."""
    xf = x.float()
    delta = xf - _bounded(xf, lo, hi)
    if multiplier is not None:
        delta = delta * multiplier
    return torch.where(finite(xf), delta, lo - lo)


def one_stage(dim: int, width: int) -> bool:
    """Whether a two-stage reduction over `dim` with first-stage partials `width` wide runs as
    one reduction instead: where the partials would not tile `dim`, or there would be one."""
    return bool(dim % width) or dim <= width


def row_reduce(
    v: torch.Tensor, reduce: Callable[..., torch.Tensor], cols_per_partial: int = 256
) -> torch.Tensor:
    """`reduce(v, dim=1, keepdim=True)` of 2-D v, [R, 1], for an order-independent `reduce`
    (here always torch.amax: see `_row_min`), in two stages for long rows: over column chunks,
    then over the chunks. Exactly the one-stage result. Two stages keep a store of v's values
    out of the reduction's kernel: a store fused there is tiled a few rows by a whole row wide,
    and a transposed store of the same input fused into it is ~10x slower."""
    r, c = v.shape
    if one_stage(c, cols_per_partial):
        return reduce(v, dim=1, keepdim=True)
    chunks = reduce(v.reshape(r, c // cols_per_partial, cols_per_partial), dim=2)
    return reduce(chunks, dim=1, keepdim=True)


def _row_min(v: torch.Tensor) -> torch.Tensor:
    """v's row minima as -max(-v), the same values: the partitioner counts amax as fusible but
    not amin, and a read of x that comes after an op it cannot fuse is one it will not recompute
    in backward (partition_hints.py, 2), so OCC's wgrad operand would be saved."""
    return -row_reduce(-v, torch.amax)


def _row_extrema(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, min) over the columns of 2-D x, [R, 1] float32 each, NaN where a row holds a NaN.
    Exact in x's own dtype, so compiled they read x (bf16: 2 bytes an entry) and both callers'
    identical nodes are computed once."""
    return row_reduce(x, torch.amax).float(), _row_min(x).float()


def clamped_row_amax(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """|clamp(x, lo, hi)|.amax over the columns of 2-D x, [R, 1] float32, from x's row extrema
    (module docstring): equal bit for bit to `row_reduce(clamp(x, lo, hi).abs(), torch.amax)`
    for finite bounds. (Non-finite bounds come from a sample without a finite entry: every
    output of the layer is NaN then, whatever the scales.)"""
    top, bottom = _row_extrema(x)
    return torch.maximum(clamp(top, lo, hi).abs(), clamp(bottom, lo, hi).abs())


def remainder_row_amax(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """|remainder(x, lo, hi)|.amax over the columns of 2-D x, [R, 1] float32, from the same row
    extrema as `clamped_row_amax` (module docstring): equal bit for bit to
    `row_reduce(remainder(x, lo, hi).abs(), torch.amax)` in every row of finite entries. A row
    with a NaN or ±inf gets a finite value that ignores them (0 where both extrema are
    non-finite); its clamped part's amax is NaN or inf there, so the row's outputs are NaN."""
    top, bottom = _row_extrema(x)
    return torch.maximum(remainder(top, lo, hi).abs(), remainder(bottom, lo, hi).abs())
