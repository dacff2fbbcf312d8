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

import torch

from minifloat import formats
from minifloat.exact import div_rn_by_scale
from minifloat.formats import ElementFormat
from minifloat.recipe_specs import DGEConfig

__all__ = ["dge_function", "dge_derivative", "derivative", "dge_scale", "grid_position"]


def _interval_start(x: torch.Tensor, fmt: ElementFormat) -> tuple[torch.Tensor, ...]:
    """For |x| (clamped to max): mag, and the grid interval [a, a + δ) holding it, as a, δ and
    1/δ, in x's dtype.

    δ is the grid spacing of mag's binade (`fmt.spacing`, a power of two) and a = floor(mag/δ)·δ,
    both exact: the same a and δ as a search of the grid, but a few instructions instead of a
    binary search with gathers (DGE runs on every weight each step). max itself is a grid point,
    so it starts an interval of its own here ([max, max + δ)).
    """
    mag = x.abs().clamp(max=fmt.max)
    # Grid spacings are powers of two: multiplying by the reciprocal is exact, and unlike a
    # division it compiles to the same bits (Triton's float32 division is approximate).
    delta, inv_delta = fmt.spacings(mag)
    return mag, torch.floor(mag * inv_delta) * delta, delta, inv_delta


def _intervals(x: torch.Tensor, fmt: ElementFormat) -> tuple[torch.Tensor, ...]:
    """For |x| (clamped to max): the enclosing grid interval's a, δ and t, in x's dtype; max
    takes the last interval [below_max, max] (t = 1), as f needs."""
    mag, a, delta, inv_delta = _interval_start(x, fmt)
    a_top = fmt.below_max
    top = mag >= fmt.max
    a = torch.where(top, a_top, a)
    delta = torch.where(top, fmt.max - a_top, delta)
    inv_delta = torch.where(top, 1.0 / (fmt.max - a_top), inv_delta)
    return a, delta, _position(mag, a, inv_delta)


def _position(mag: torch.Tensor, a: torch.Tensor, inv_delta: torch.Tensor) -> torch.Tensor:
    """t = 2(mag - a)/δ - 1, in [-1, 1] without a clamp: mag - a is exact (a <= mag <= 2a, or
    a = 0), the products by powers of two too, so t is 2u - 1 rounded for an exact u in [0, 1]
    (NaN stays NaN)."""
    return 2.0 * (mag - a) * inv_delta - 1.0


def _working_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def dge_function(
    x_scaled: torch.Tensor, fmt: str | ElementFormat = "e2m1", k: float = 5.0
) -> torch.Tensor:
    """The smooth quantizer stand-in f(x) (for tests and plots), in float32 (float64 kept).
    k as `dge_derivative`'s (a finite number >= 1; k <= 0 gave NaN or 0-division)."""
    DGEConfig(k=k)  # its checks of k
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
        k: sharpness, a finite number >= 1; k = 1 is the straight-through estimator (f' = 1),
            larger k approaches the hard quantizer (the paper uses 5). Below 1, f would be flat
            at the midpoints and steep at the grid points: the opposite of a quantizer; k = inf
            would zero every gradient. Both are refused (DGEConfig).
        cap: upper bound of the derivative near midpoints (the paper uses 3.0), finite and > 0.
    NaN in x gives NaN (the step guard must see it). ±inf in x, like any value beyond ±max,
    counts as sitting on ±max and gives 1/k (module docstring): finite, so an infinite weight
    is the quantizer's and the step guard's to catch, not this derivative's.
    """
    return derivative(x_scaled, fmt, DGEConfig(k=k, cap=cap))


def derivative(x_scaled: torch.Tensor, fmt: str | ElementFormat, cfg: DGEConfig) -> torch.Tensor:
    """`dge_derivative` with a recipe's DGEConfig (the form the backward calls). Its constants
    come from `cfg.key` (`_constants`), so compiled code never holds k or cap as a symbol."""
    if not isinstance(cfg, DGEConfig):
        raise TypeError(f"cfg must be a DGEConfig, got {type(cfg).__name__}")
    fmt = formats.get(fmt)
    x = x_scaled.to(_working_dtype(x_scaled))
    scale, exponent, cap = _constants(cfg.key)
    if exponent == 0.0:  # k = 1, the straight-through estimator: f' = min(1, cap), NaN kept
        return torch.where(torch.isnan(x), x, torch.full_like(x, min(scale, cap)))
    # |t| alone: on max, t = -1 of [max, max + δ) rather than 1 of [below_max, max], the same
    # |t| without the selects of the last interval.
    mag, a, _, inv_delta = _interval_start(x, fmt)
    u = _position(mag, a, inv_delta).abs()
    # +inf at t = 0 (exact midpoints), which the cap turns into `cap`; NaN stays NaN through
    # every step, the clamp's included.
    return (scale * _power(u, exponent)).clamp(max=cap)


def _power(u: torch.Tensor, exponent: float) -> torch.Tensor:
    """u^exponent for u = |t| in [0, 1], as each device evaluates it best (neither is correctly
    rounded; tests/tolerances.py has their bounds against float64).

    CUDA: exp2(exponent·log2 u), libdevice's exp2 and log2, each a hardware approximation plus
    the handling of special values; within 8 ulp (measured for this form on the CPU, 7.0 ulp
    at k = 10; checked on the GPU by tests/test_dge.py). libdevice's `powf` (~1 ulp) was 4.6 ms
    of a 1.3B fp4-dge step (session 41); this form took 1.0-1.5 ms off it (session 59). The
    Hopper backend's eager calls run the compiled code (`HopperBackend.kernel`).
    CPU: `pow`, ~1 ulp, whose ATen and inductor C++ forms differ only in vector tails (an ulp
    or two; test_compile's layers agree bit for bit); their log2 (log, exp too) differ in the
    last bit on ~0.9 % of inputs (torch 2.13), which broke compiled == eager there.
    """
    if u.is_cuda:
        return torch.exp2(exponent * torch.log2(u))
    return u.pow(exponent)


@torch.compiler.assume_constant_result  # Python floats in the graph, whatever dynamo made of k
def _constants(key: str) -> tuple[float, float, float]:
    """1/k, 1/k - 1 and cap of the DGEConfig whose `key` this is."""
    k, cap = (float.fromhex(v) for v in key.split())
    return 1.0 / k, 1.0 / k - 1.0, cap


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
    one float32 product an element, or the division `exact.div_rn_by_scale` (float64). The
    float32 power of f′ is not correctly rounded (`_power`: exp2·log2 on CUDA, pow on the CPU), so
    devices differ by a few ulp; the Hopper backend runs this compiled in eager too (`kernel`).
    ValueError for a `dw` not of w's shape, or a `w_scale`/`w_mult` of another rank than w's
    (a 1-D [N] of a square weight would broadcast along its columns); one element is fine.
    """
    _check_dge_shapes(dw, w, w_scale, w_mult)
    w = w.detach().float()
    w_scaled = div_rn_by_scale(w, w_scale.float()) if w_mult is None else w * w_mult.float()
    return dw.float() * derivative(w_scaled, fmt, cfg)


def _check_dge_shapes(
    dw: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, w_mult: torch.Tensor | None
) -> None:
    """dge_scale's shapes (no pass over values: it runs in compiled backward code)."""
    if dw.shape != w.shape:
        raise ValueError(f"dw must have w's shape {tuple(w.shape)}, got {tuple(dw.shape)}")
    for name, t in (("w_scale", w_scale), ("w_mult", w_mult)):
        if t is not None and t.numel() != 1 and t.dim() != w.dim():
            raise ValueError(
                f"{name} must have w's rank {w.dim()} (e.g. [N, 1] row scales) or one element, "
                f"got shape {tuple(t.shape)}"
            )
