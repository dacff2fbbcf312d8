"""The Differentiable Gradient Estimator (DGE) of 2501.17116, for quantized weights.

The straight-through estimator treats the quantizer as the identity in backward. DGE instead
differentiates a smooth stand-in for the staircase: between adjacent grid points a < b
(δ = b - a) of the element format,

    f(x) = a + (δ/2) · (1 + sign(t) · |t|^(1/k)),   t = 2(x - a)/δ - 1 ∈ [-1, 1],

odd-symmetric for negative x. f passes through every grid point and is steep near the midpoints,
like the real quantizer. Its derivative f'(x) = (1/k)·|t|^(1/k - 1) equals 1/k on grid points
and diverges at midpoints, so it is capped. The wgrad of a DGE recipe is multiplied element-wise
by f' evaluated on the *scaled* weight, the values the quantizer rounds: w * m for "inv" scales
(values round(w * m), `formats.inv_scales`), w / w_scale for the others.

Beyond ±max (reachable only through the fp32 rounding of `amax / max`, or with a non-absmax
scale) x is treated as sitting on ±max, giving 1/k: a saturating quantizer's gradient there would
be 0, but absmax scaling puts each channel's largest weight exactly at max and zeroing its
gradient would freeze the channel's largest weight.
"""

from __future__ import annotations

import math
import struct

import torch

from minifloat import formats
from minifloat.exact import div_rn_by_scale
from minifloat.formats import ElementFormat
from minifloat.recipe_specs import DGEConfig

__all__ = ["dge_function", "dge_derivative", "derivative", "dge_scale", "grid_position"]


def _intervals(x: torch.Tensor, fmt: ElementFormat) -> tuple[torch.Tensor, ...]:
    """For |x| (clamped to max): the enclosing grid interval's a, δ and t, in x's dtype.

    The interval [a, a + δ) holding mag is found arithmetically: δ is the grid spacing of mag's
    binade (`fmt.spacing`, a power of two) and a = floor(mag / δ)·δ, both exact; max itself
    takes the last interval [below_max, max]. The same a and δ as a search of the grid, but a few
    instructions instead of a binary search with gathers (DGE runs on every weight each step).
    """
    mag = x.abs().clamp(max=fmt.max)
    a_top = fmt.below_max
    # Grid spacings are powers of two: multiplying by the reciprocal is exact, and unlike a
    # division it compiles to the same bits (Triton's float32 division is approximate).
    delta, inv_delta = fmt.spacings(mag)
    a = torch.floor(mag * inv_delta) * delta
    top = mag >= fmt.max
    a = torch.where(top, a_top, a)
    delta = torch.where(top, fmt.max - a_top, delta)
    inv_delta = torch.where(top, 1.0 / (fmt.max - a_top), inv_delta)
    t = (2.0 * (mag - a) * inv_delta - 1.0).clamp(-1.0, 1.0)
    return a, delta, t


def _working_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def dge_function(
    x_scaled: torch.Tensor, fmt: str | ElementFormat = "e2m1", k: float = 5.0
) -> torch.Tensor:
    """The smooth quantizer stand-in f(x) (for tests and plots), in float32 (float64 kept)."""
    fmt = formats.get(fmt)
    x = x_scaled.to(_working_dtype(x_scaled))
    a, delta, t = _intervals(x, fmt)
    mag = a + 0.5 * delta * (1.0 + torch.sign(t) * t.abs().pow(1.0 / k))
    return torch.copysign(mag, x)


def grid_position(x_scaled: torch.Tensor, fmt: str | ElementFormat = "e2m1") -> torch.Tensor:
    """t ∈ [-1, 1]: where |x| sits in its grid interval (-1 on the lower grid point, 0 at the
    midpoint, 1 at the upper one), the variable of f and f′; float32 (float64 kept)."""
    return _intervals(x_scaled.to(_working_dtype(x_scaled)), formats.get(fmt))[2]


def dge_derivative(
    x_scaled: torch.Tensor, fmt: str | ElementFormat = "e2m1", k: float = 5.0, cap: float = 3.0
) -> torch.Tensor:
    """f'(x) = min((1/k)·|t|^(1/k - 1), cap), element-wise, in float32 (float64 kept).

    Args:
        x_scaled: weights divided by their scale (|x| <= fmt.max under absmax scaling).
        fmt: element format whose grid defines the intervals (E2M1 for the paper's recipe).
        k: sharpness, >= 1; k = 1 is the straight-through estimator (f' = 1), larger k
            approaches the hard quantizer (the paper uses 5). Below 1, f would be flat at the
            midpoints and steep at the grid points: the opposite of a quantizer.
        cap: upper bound of the derivative near midpoints (the paper uses 3.0).
    float32 reads the power from tables (`_unit_power`, within 3 ulp of the exact value),
    float64 computes it with `pow`. NaN in x gives NaN (the step guard must see it). Under
    torch.compile, k and cap must be constants of the graph (as a recipe's are).
    """
    return derivative(x_scaled, fmt, DGEConfig(k=k, cap=cap))


def derivative(x_scaled: torch.Tensor, fmt: str | ElementFormat, cfg: DGEConfig) -> torch.Tensor:
    """`dge_derivative` with a recipe's DGEConfig. Compiled code passes the config rather than
    its floats: dynamo traces a float that changed between compilations as a symbol, and the
    power's tables need its value (`_power_tables` reads it from `DGEConfig.k_key`)."""
    fmt = formats.get(fmt)
    x = x_scaled.to(_working_dtype(x_scaled))
    _, _, t = _intervals(x, fmt)
    # |t|^(1/k-1) is +inf at t = 0 (exact midpoints); the cap turns that into `cap`.
    if x.dtype == torch.float64:
        deriv = (1.0 / cfg.k) * t.abs().pow(1.0 / cfg.k - 1.0)
    else:
        deriv = _unit_power(t.abs(), cfg)
    deriv = deriv.clamp(max=cfg.cap)
    return torch.where(torch.isnan(x), x, deriv)


# |t|^a from tables: |t| = 2^e · m (m in [1, 2)); the top _BUCKET_BITS bits of m's fraction pick
# a bucket [m_j, m_j + 2^-_BUCKET_BITS), and (m / m_j)^a = (1 + s)^a, s < 2^-7, is the binomial
# series to s^3 (the rest < 2^-28 for |a| <= 1). The float32 pow it replaces is a libdevice call
# that cost ~4.6 ms of a 1.3B fp4-dge step on the H200 (benchmarks/results/
# train_interleaved_1.3B_ours_s41_dge_floor_...: fp4-dge:dge.k=0.5, whose power is |t|^1, ran
# 224.8 against 229.4 ms); CPU and CUDA's pow also differ in the last bit, the tables do not.
_BUCKET_BITS = 7


@torch.compiler.assume_constant_result  # constants, so dynamo does not trace the loops
def _power_tables(k_key: str) -> tuple[tuple[float, ...], ...]:
    """For k = float.fromhex(k_key) (`DGEConfig.k_key`: torch 2.11's dynamo takes no frozen
    dataclass as the argument of a constant function, and a float may be traced as a symbol),
    a = 1/k - 1 and scale = 1/k: scale·2^(e·a) by float32 biased exponent e; m_j^a and
    1/m_j by bucket j (float64 values, rounded to float32 as tensors); the series' C(a, 1..3),
    rounded to float32 here so that every backend reads the same constants.

    Entry 0 of the first stands for |t| = 0 (and subnormals, which `_intervals` never returns:
    its t are multiples of 2^-24): scale·0^a.
    """
    scale = 1.0 / float.fromhex(k_key)
    a = scale - 1.0
    buckets = 1 << _BUCKET_BITS
    zero = math.inf if a < 0 else scale
    by_exponent = tuple(scale * 2.0 ** ((e - 127) * a) if e else zero for e in range(128))
    m_j = [1.0 + j / buckets for j in range(buckets)]
    c2 = a * (a - 1.0) / 2.0
    series = tuple(struct.unpack("f", struct.pack("f", c))[0] for c in (a, c2, c2 * (a - 2) / 3))
    return by_exponent, tuple(m**a for m in m_j), tuple(1.0 / m for m in m_j), series


def _unit_power(u: torch.Tensor, cfg: DGEConfig) -> torch.Tensor:
    """(1/k)·u^a, a = 1/k - 1 in (-1, 0], for float32 u in {0} ∪ [2^-126, 1], in float32, with
    the same bits eager and compiled, and by construction on the CPU and on CUDA alike (NaN
    entries: the caller masks them).

    Only table reads, bit operations, float32 products and sums. Triton may contract a product
    and the sum that uses it into one FMA, which eager never does, so each product passes a
    clamp that cannot bind (|s·p| < 2^-6) before its sum.
    """
    *tables, (c1, c2, c3) = _power_tables(cfg.k_key)
    by_exponent, by_bucket, recip = (
        torch.tensor(t, dtype=torch.float32, device=u.device) for t in tables
    )  # under torch.compile: constants of the graph
    bits = u.view(torch.int32)
    e = (bits >> 23).clamp(0, 127)  # biased exponent (NaN: 255, clamped; masked later)
    j = (bits >> (23 - _BUCKET_BITS)) & ((1 << _BUCKET_BITS) - 1)
    one = 0x3F800000  # the bits of 1.0: a fraction field or-ed in gives a value in [1, 2)
    m = ((bits & 0x7FFFFF) | one).view(torch.float32)
    m_j = ((bits & (0x7FFFFF ^ ((1 << (23 - _BUCKET_BITS)) - 1))) | one).view(torch.float32)
    s = (m - m_j) * recip[j]  # m - m_j is exact
    p = (s * c3).clamp(max=1.0) + c2
    p = (s * p).clamp(max=1.0) + c1
    p = (s * p).clamp(max=1.0) + 1.0
    return by_exponent[e] * by_bucket[j] * p


def dge_scale(
    dw: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    cfg: DGEConfig,
    fmt: str | ElementFormat = "e2m1",
    w_mult: torch.Tensor | None = None,
) -> torch.Tensor:
    """DGE's weight-gradient correction dw * f'(w scaled), float32.

    The scaled weight is w * w_mult where the quantizer multiplied ("inv" scales: its
    multipliers m, `QOperand.multiplier`), else w / w_scale. `w_scale` and `w_mult` broadcast
    against `w` (e.g. [N, 1] row scales). Plain PyTorch that torch.compile fuses into one pass:
    one float32 product an element, or the division `exact.div_rn_by_scale` (float64), so
    compiled equals eager either way.
    """
    w = w.detach().float()
    w_scaled = div_rn_by_scale(w, w_scale.float()) if w_mult is None else w * w_mult.float()
    return dw.float() * derivative(w_scaled, fmt, cfg)
