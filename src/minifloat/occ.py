"""Outlier Clamping and Compensation (OCC) of 2501.17116, for activations.

A few large activations stretch the absmax scale of their token and push every other value of it
into FP4's coarse low range. OCC clamps the input x to its per-tensor [1-alpha, alpha] quantiles
before quantization, x_c = clamp(x, q_{1-alpha}, q_alpha), and adds back the clipped remainder
Δx = x - x_c (≈ 2(1-alpha) of the entries are non-zero) through a second GEMM:

    y = Q(x_c) · Q(w)ᵀ + Δx · wᵀ

Everything here is plain PyTorch with static shapes (no `nonzero`, no `.item()`): under
torch.compile it is traced into the caller's graph without breaks or recompiles, and inductor
fuses the clamp, the remainder and their quantizers into the passes that already read x.

Thresholds ("sampled"): the quantiles of every s-th entry of x, about `sample_size` of them. s is
the smallest prime >= numel / sample_size that does not divide the row length K, so entry
i·s falls in column i·s mod K and the sample visits every column equally often (a channel of
massive activations is sampled in proportion). The sample's quantiles replace x's: on CUDA by a
radix select (kernels/quantiles.py), elsewhere by `quantize.tensor_quantiles`, the same values.

Compensation in E4M3 (the default; "fp32" is the dense fp32 reference it is measured against):
- fprop: Δx quantized per row to E4M3 and multiplied by the E4M3 row-quantized weight in a
  second FP8 GEMM, dense: the clipped entries of an activation spread over every channel
  (benchmarks/recipe_sqnr.py inputs; and a 125M model's real inputs mid-training, where the top
  5 % of channels hold 18-57 % of the remainder's energy and compensating only the top 12.5 %
  loses 2 dB of y on average, benchmarks/occ_real_activations.py, session 68), so restricting
  the GEMM to a few columns cannot hold them.
- wgrad: the remainder is folded into the saved input (`fold_remainder`): z = x_q + Δx·m_x
  (m_x: x_q's multiplier, s_x = 1 / m_x rounded; Δx / s_x for scales without one) is stored in
  E4M3 with a power-of-two tensor scale, and dw = dyᵀ · z s_x is the one wgrad GEMM; the saved
  activation is one byte per entry and no extra GEMM runs. Under torch.compile nothing is
  saved: z is recomputed in backward (partition_hints.py).
- dgrad: the straight-through estimator through the clamp (clamp plus compensation is the
  identity on x).
"""

from __future__ import annotations

import struct

import torch

from minifloat import formats
from minifloat.exact import div_rn, div_rn_by_scale
from minifloat.kernels.clip import clamp, remainder, remainder_row_amax
from minifloat.kernels.operand import e2m1_values, round_to_storage
from minifloat.kernels.quantiles import clip_bounds
from minifloat.quantize import Granularity, quantize
from minifloat.recipes import OCCConfig

__all__ = [
    "sample_stride",
    "thresholds",
    "clamp",
    "remainder",
    "fold_remainder",
    "clamped_grid_values",
    "steps_passed",
    "joint_lhs",
    "joint_rhs",
    "occ_activation",
    "clipped_fraction",
]

_E4M3_MAX_BITS = struct.unpack("<i", struct.pack("<f", formats.get("e4m3").max))[0]  # 0x43E00000
# `steps_passed`'s steps 448·2^0 .. 448·2^63, so `fold_remainder`'s power-of-two tensor scales t
# run from 2^0 to 2^64 (float32: 448·2^63 is finite, and 2^-64 a normal).
_FOLD_EXPONENTS = 64
# `joint_lhs`'s row multipliers f·2^-a, as (f, least a, greatest a): the factors f whose
# products with every E2M1 value have at most 4 significant bits, each over the shifts that keep
# those products exact in E4M3 (at most 448: 6·2^6 = 384; multiples of 2^-9, its least
# subnormal: 0.5·2^-8, 0.625·2^-6, 0.75·2^-7). `joint_rhs` shifts by 2^6.
_JOINT_FACTORS = ((1.0, -6, 8), (1.25, -5, 6), (1.5, -5, 7))
_JOINT_MIN_SHIFT = min(least for _, least, _ in _JOINT_FACTORS)  # the union of those ranges
_JOINT_MAX_SHIFT = max(most for _, _, most in _JOINT_FACTORS)
_JOINT_WIDEST_MOST = _JOINT_FACTORS[0][2]  # f = 1's: its range holds every row the others do
# `joint_lhs`'s steps past f's range (`steps_passed`'s count): a finite row passes at most 114
# (reach·f·2^-most < 2^122 < 448·2^114), so a <= 8 + 114 and 2^-a is a normal; +inf passes all
# 118, which must be more than 114 and at most 118: an infinite row's a, 8 + 1 + 118 = 127, is
# `_pow2`'s largest exponent (and `steps_passed` allows 120).
_JOINT_BEYOND = 118
_JOINT_RHS_SHIFT = 64.0


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


def sample_stride(numel: int, row_len: int, sample_size: int) -> int:
    """The stride s of the threshold sample of a [numel / row_len, row_len] tensor.

    1 (every entry: the exact quantiles) when numel <= sample_size; else the smallest prime
    s >= numel / sample_size that does not divide row_len (so the sample visits every column).
    """
    if sample_size < 1:
        raise ValueError(f"sample_size must be >= 1, got {sample_size!r}")
    if numel <= sample_size:
        return 1
    if row_len < 1:  # every s divides 0: the search below would never end
        raise ValueError(f"row_len must be >= 1 for a non-empty tensor, got {row_len!r}")
    s = max(2, -(-numel // sample_size))
    while not _is_prime(s) or row_len % s == 0:
        s += 1
    return s


def thresholds(x: torch.Tensor, cfg: OCCConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The clamp bounds (lo, hi) of x under `cfg`, 0-dim float32 tensors on x's device.

    "exact": the [1-alpha, alpha] quantiles of x's finite entries (linear interpolation, as
    `torch.quantile`); "sampled": the same quantiles of the strided sample (module docstring).
    """
    if not isinstance(cfg, OCCConfig):
        raise TypeError(f"cfg must be an OCCConfig, got {type(cfg).__name__}")
    if x.dim() == 0:
        raise ValueError("thresholds takes a tensor of at least 1 dim (rows of x.shape[-1])")
    flat = x.detach().reshape(-1)
    if cfg.threshold == "sampled":  # a copy of the sample: compiled, the sort then reads the
        # sampled entries, where a strided view of x made inductor write all of x out for it
        flat = flat[:: sample_stride(flat.numel(), x.shape[-1], cfg.sample_size)].contiguous()
    # lo and hi as two entries of one tensor: compiled, the partitioner saves it whole, and the
    # clamp's kernels read one buffer fewer (the remainder's zero is no longer a third), so
    # inductor no longer writes the SwiGLU output's remainder out in float32
    # (docs/hopper_sessions.md, session 33)
    # on CUDA a radix select instead of a sort (kernels/quantiles.py), the same values
    clip = clip_bounds(flat, cfg.alpha)
    return clip[0], clip[1]


def fold_remainder(
    x: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    x_values: torch.Tensor | None,
    x_scale: torch.Tensor,
    x_multiplier: torch.Tensor | None,
    values_max: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The wgrad operand z = x_q + Δx·m_x in E4M3, with its power-of-two tensor scale t.

    Args:
        x: [M, K] the layer input; lo, hi: its clamp bounds.
        x_values: [M, K] grid values of x_q = Q(clamp(x)) (any float dtype, e.g. E4M3 bytes),
            each at most `values_max` in magnitude (x_q's format's largest value); or None
            for an E2M1 "inv" x_q rounded to nearest (`x_multiplier` given): recomputed from
            x as its quantizer rounds them (`clamped_grid_values`).
        x_scale: x_q's scale s_x, [M, 1] (row) or [1, 1] (tensor).
        x_multiplier: an "inv" x_q's multiplier m_x (x_q = round(x_c·m_x), s_x = 1 / m_x
            rounded; `QOperand.multiplier`), or None for scales without one ("fp32", "pow2"),
            where Δx·m_x is the correctly rounded quotient Δx / s_x instead.
    Returns:
        (values float8_e4m3fn [M, K], t float32 [1, 1]) with values · t ≈ z, so that
        values · t · s_x ≈ x_q s_x + Δx = x_c + (x - x_c) up to x_q's and this rounding.
        t = the least power of two >= 1 with B / t <= 448, B = max over rows of
        values_max + max|Δx|·m_x (float32, each product or quotient rounded once), a bound on
        |z| that needs no pass over z: only the remainder's row maxima, which fprop's
        compensation computes anyway. (With t from z's own maximum, a compiled step
        recomputing z in backward reduced over z there first: 4 % of a 1.3B fp4 step;
        docs/hopper_sessions.md, session 32.)
        Where z = x_values (no clipping) the values stay exact in E4M3 while t <= 2^8.
    """
    # |z| <= values_max + |Δx|·m_x entry by entry, and the roundings are monotone. The row
    # maxima are the ones fprop's E4M3 compensation quantizer takes of the same Δx, from x's
    # row extrema (kernels/clip.py; the compiled graph computes them once). Taken first: were
    # the quotient's float64 reciprocals an opaque op, that would be the first op inductor
    # cannot fuse that reads from x, and the partitioner would not recompute a read of x
    # placed after it (partition_hints.py, 2), so it would save z
    if x_values is None and x_multiplier is None:
        raise ValueError("x_q's values can be recomputed only for an 'inv' x_q (its multiplier)")
    row_max = remainder_row_amax(x, lo, hi)
    if x_multiplier is None:
        delta_max = div_rn(row_max, x_scale.float())
        # the fold's float64 reciprocals from the graph (`in_graph`), from a kernel that runs
        # anyway: 96 launches fewer a 1.3B fp4 step while fp4 took this path, the same bits
        # (session 24 had found it no faster; docs/hopper_sessions.md, session 75; since session
        # 76 fp4 takes Δx·m_x below)
        delta = div_rn_by_scale(remainder(x, lo, hi), x_scale.float(), in_graph=True)
    else:
        # Δx on x_q's own multiplier, as fprop's compensation takes it (`joint_lhs`): one
        # float32 product an element where the quotient converts to float64 and back; z alone
        # 0.225 against 0.236 ms at 16384 x 5632 on an H200. The product is taken behind the
        # remainder's select (`remainder`'s multiplier): a plain product before the addition below
        # was contracted into an FMA by compiled Triton, every clipped crafted entry (768 of
        # 1,024) off eager's bits (session 72 reverted that form; docs/hopper_sessions.md,
        # session 76). The bound's [M, 1] product in float64, exact, then rounded once: the
        # same value as float32's product, and none left to contract either
        m = x_multiplier.float()
        delta_max = (row_max.double() * m.double()).float()
        delta = remainder(x, lo, hi, m)
    if x_values is None:
        x_values = clamped_grid_values(x, lo, hi, x_multiplier)
    z = x_values.float() + delta
    shift = steps_passed((values_max + delta_max).amax(), 0, _FOLD_EXPONENTS).reshape(1, 1)
    # z / t as z · (1 / t) in float32: the exact quotient, rounded once where it is a float32
    # subnormal (as the quotient is) or flushed to zero by a GPU (E4M3's zero either way). So
    # the bytes of `div_rn_by_scale(z, t)` without its two float64 conversions an element, in
    # the backward pass that recomputes z (docs/hopper_sessions.md, session 71)
    return round_to_storage(z * _pow2(-shift), "e4m3"), _pow2(shift)


def clamped_grid_values(
    x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, x_multiplier: torch.Tensor | None
) -> torch.Tensor:
    """float32 [M, K]: the values of x_q = Q(clamp(x, lo, hi)) for an E2M1 "inv" quantizer
    rounding to nearest, recomputed from x by its ops (kernels/operand.py: the clamp, the
    product by m_x, E2M1's rounding unclamped), so equal to its E4M3 bytes read as float32.
    The joint operand and the fold take these rather than the bytes: reading x_q back from
    E4M3 cost two conversions an element in kernels bound by their instructions, ~4 % of the
    SwiGLU forward's that writes the down projection's joint operand (sm_90 SASS, 407 against
    391 instructions a thread; docs/hopper_sessions.md, session 77)."""
    if x_multiplier is None:
        raise ValueError("x_q's values can be recomputed only for an 'inv' x_q (its multiplier)")
    return e2m1_values(clamp(x, lo, hi) * x_multiplier.float(), saturate=False)


def steps_passed(v: torch.Tensor, least: int, count: int) -> torch.Tensor:
    """How many of the steps 448·2^j, j = least .. least + count - 1, each entry of float32 `v`
    passes (v > 448·2^j), int32, v's shape: 0 for NaN and negatives, `count` for +inf. The
    steps must be finite normals: least >= -134 and least + count <= 120 (count >= 0).

    From v's bits, as exact as the comparisons (a non-negative float32 orders as its int32
    bits, and 448·2^j, a normal for j >= -134, has the bits 0x43E00000 + j·2^23), in
    elementwise integer ops, where `(v[..., None] > steps).sum(-1)` is a reduction of its own
    once compiled: the fold's t and 1 / t as products of factors of 2 over the steps were two
    kernels a call, 96 calls a 1.3B fp4 step (until session 74), and the joint factor's shifts
    one a candidate factor, 288 launches a step (until session 75)."""
    if least < -134 or count < 0 or least + count > 120:
        raise ValueError(
            f"steps_passed needs -134 <= least, count >= 0 and least + count <= 120 (448·2^j a "
            f"finite normal), got least {least}, count {count}"
        )
    bits = v.float().view(torch.int32)  # negative for negative v, beyond every step for NaN
    # clamped below the first step first: v - 448 in bits without wrapping around
    d = bits.clamp(min=_E4M3_MAX_BITS + (least - 1) * 2**23) - _E4M3_MAX_BITS
    passed = (-((-d) >> 23) - least).clamp(0, count)  # #{j >= least: j·2^23 < d}, capped
    return torch.where(v == v, passed, 0)


def joint_lhs(
    x: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    x_values: torch.Tensor | None,
    x_multiplier: torch.Tensor,
    x_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fprop's lhs with compensation in one operand: [x_q·g | E4M3(Δx·m_x·g)], [M, 2K].

    Args:
        x: [M, K] the layer input; lo, hi: its clamp bounds.
        x_values, x_multiplier, x_scale: x_q = Q(clamp(x)), an "inv" row-scaled E2M1 operand
            rounded to nearest (values [M, K], e.g. its E4M3 bytes, or None: recomputed from
            x as the quantizer rounds them, `clamped_grid_values`; multipliers m_x and scales
            1 / m_x, [M, 1]).
    Returns:
        (values float8_e4m3fn [M, 2K], scales float32 [M, 1] = s_x / g): times the rhs of
        `joint_rhs`, one GEMM gives x_q·w_qᵀ + Δx_q·w8ᵀ, the two products of OCC's fprop.
        g = f·2^-a per row, f in {1, 1.25, 1.5} and a in f's range (`_JOINT_FACTORS`), so that
        x_q's E2M1 values times g are exact in E4M3: for each f the least a that keeps the
        row's largest |Δx·m_x|·g within 448, and of those the f that rounds that entry to E4M3
        closest (ties: the smaller f). The remainder is rounded once, on x_q's own scale
        over g: its own absmax scale would make each row's largest entry exact, and with g
        from powers of two alone y's SQNR fell up to 0.25 dB (session 65). A factor is a
        candidate only where its range holds the row; a row past every range (a remainder
        over 448·2^8 of x_q's scale; not seen in training) takes f = 1 and a past 8, the
        least that holds the remainder, x_q's values in it then rounded to E4M3 too: its
        outliers kept, where ±448 would cut them. A row whose remainder overflows float32 on
        x_q's scale gets g = 0 (and a finite scale), so y's row is NaN.
        So no entry passes ±448 and neither half needs a saturating cast: sm_90's E4M3
        conversion saturates and torch's eager cast makes NaN, bit-equal only where nothing
        passes, and the selects that made them agree cost ~8 % of the SwiGLU forward kernel
        that writes the down projection's joint operand (session 78).
    """
    reach = remainder_row_amax(x, lo, hi) * x_multiplier  # >= every |Δx m_x| (monotone)
    f, f_inv = _joint_factor(reach)
    least = torch.zeros_like(reach, dtype=torch.int32)
    most = torch.zeros_like(reach, dtype=torch.int32)
    for f_c, least_c, most_c in _JOINT_FACTORS:  # f's range of a
        least = torch.where(f == f_c, least_c, least)
        most = torch.where(f == f_c, most_c, most)
    # the shifts past `most` that a row passing f's range needs (0 in range, _JOINT_BEYOND
    # for +inf alone). Only f = 1 can be past its range (`_joint_factor`), so from reach alone:
    # other factors' rows are under 448·2^8 and pass none; off f's chain, so the per-row
    # kernels can take it beside the factor's choice
    beyond = steps_passed(reach * 2.0**-_JOINT_WIDEST_MOST, 0, _JOINT_BEYOND)
    # j >= a for j in f's range: the steps 448·2^j that reach·f does not pass, and `most`
    # (standing for a = most + beyond) unless the row is infinite
    j = torch.arange(_JOINT_MIN_SHIFT, _JOINT_MAX_SHIFT + 1, device=x.device, dtype=torch.int32)
    passes = reach * f > 448.0 * _pow2(j)  # False for NaN, as a's least (`_joint_factor`)
    top = j == most
    at_or_above = (j >= least) & (j <= most) & ((top & (beyond < _JOINT_BEYOND)) | ~passes)
    a = most + 1 - at_or_above.sum(dim=1, keepdim=True, dtype=torch.int32) + beyond
    # g = f·2^-a as a reduction's own output (the largest f·2^-j over j >= a, 0 for none):
    # main and delta read it in one load. Built from f, a and f's range after the reductions,
    # g's ops pushed theirs past inductor's limit (30): it wrote both as float32 [M, K]
    # buffers in the pass over x and copied them into a pointwise cat, 3.4 ms a 6-layer 1.3B
    # step (session 66)
    shift = torch.where(top, j + beyond, j)
    gain = torch.where(at_or_above, f * _pow2(-shift), 0.0).amax(dim=1, keepdim=True)
    if x_values is None:
        x_values = clamped_grid_values(x, lo, hi, x_multiplier)
    main = round_to_storage(x_values.float() * gain, "e4m3", saturate=False)
    delta = round_to_storage(remainder(x, lo, hi) * x_multiplier * gain, "e4m3", saturate=False)
    return torch.cat([main, delta], dim=1), x_scale * (_pow2(a) * f_inv)


def _joint_factor(reach: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """joint_lhs's factor f per row and 1 / f, float32 [M, 1]: of `_JOINT_FACTORS`, the one whose
    g = f·2^-a (a: the least in f's range with reach·g <= 448) rounds the row's largest
    remainder `reach` (in x_q's scale) to E4M3 closest; ties: the smaller f. A factor whose
    range cannot hold the row is no candidate: joint_lhs would take a past that range, where
    x_q's values times g are inexact, and f = 1's range holds every row the others can (448·2^8
    against 448·2^6 / 1.25 and 448·2^7 / 1.5), so rows past it alone take f = 1 past its range."""
    best = None
    for f, least, most in _JOINT_FACTORS:
        reach_f = reach * f  # rounded as every entry times g is (g / f a power of two)
        # a from the steps the row passes, 2^a and 2^-a from exponent bits: exact in every
        # compiled form, and ops the partitioner recomputes (a `prod` of factors of 2 was not,
        # and the compiled fp4 block saved z again; session 65); the count from bits too,
        # not a reduction over the steps: one kernel fewer per factor, 288 launches a 1.3B fp4
        # step (session 75)
        a = steps_passed(reach_f, least, most - least) + least
        top = reach_f * _pow2(-a)
        rounded = round_to_storage(top, "e4m3").float()
        err = (rounded - top).abs() * (_pow2(a) * (1.0 / f))
        # f times the value this factor rounds reach to (rounded·2^a / f): exact, an E4M3
        # value times a power of two
        value_f = rounded * _pow2(a)
        cand = (err, torch.full_like(reach, f), torch.full_like(reach, 1.0 / f), value_f)
        if best is None:  # f = 1, the widest range
            best = cand
        else:
            # Two factors that round reach to one value are tied, whatever float32 makes of
            # their errors (1 / f and reach·f are rounded): compared as computed, a last-bit
            # change of reach flipped f in such rows, and the row's remainder was rounded
            # anew (session 82). The values compared cross-multiplied: each product has at
            # most 7 significant bits, so exact
            tied = value_f * best[1] == best[3] * f
            closer = (cand[0] < best[0]) & (top <= 448.0) & ~tied  # False for NaN, as before
            best = tuple(torch.where(closer, c, b) for c, b in zip(cand, best, strict=True))
    return best[1], best[2]


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent, float32, for int32 exponents in [-126, 127] (its bits: biased exponent, zero
    mantissa)."""
    return ((exponent + 127) << 23).view(torch.float32)


def joint_rhs(
    weight: torch.Tensor,
    w_values: torch.Tensor,
    w_multiplier: torch.Tensor,
    w_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fprop's rhs with compensation in one operand: [w_q 2^6 | E4M3(w m_w 2^6)], [N, 2K].

    w_values, w_multiplier, w_scale: w_q, an "inv" row-scaled E2M1 operand of `weight` [N, K].
    Returns (values float8_e4m3fn [N, 2K], scales float32 [N, 1] = s_w 2^-6). Both halves are
    on w_q's scale: the E2M1 values exactly, the weight itself rounded to E4M3 (|w m_w| <= 6, so
    at most 384 after the shift: normal down to 2^-6 of it)."""
    main = round_to_storage(w_values.float() * _JOINT_RHS_SHIFT, "e4m3", saturate=False)
    exact = weight.float() * w_multiplier * _JOINT_RHS_SHIFT
    return (
        torch.cat([main, round_to_storage(exact, "e4m3", saturate=False)], dim=1),
        w_scale * (1.0 / _JOINT_RHS_SHIFT),
    )


def occ_activation(
    x: torch.Tensor,
    fmt: str,
    granularity: Granularity,
    cfg: OCCConfig | None,
) -> torch.Tensor:
    """The activation the fprop GEMM effectively sees, float32: Q(x_c) (+ Δx if compensated).

    With `cfg=None` this is plain Q(x). Used to measure activation fidelity (paper's Table 1).
    """
    if x.dim() == 1:
        x = x.unsqueeze(0)
    x2 = x.reshape(-1, x.shape[-1])
    if cfg is None:
        return quantize(x2, fmt, granularity).dequantize().reshape(x.shape)
    lo, hi = thresholds(x2, cfg)
    out = quantize(clamp(x2, lo, hi), fmt, granularity).dequantize()
    if cfg.compensate:
        out = out + remainder(x2, lo, hi)
    return out.reshape(x.shape)


def clipped_fraction(x: torch.Tensor, cfg: OCCConfig) -> float:
    """Fraction of the finite entries of x that OCC clips (≈ 2(1-alpha))."""
    lo, hi = thresholds(x, cfg)
    xf = x.float()
    finite = torch.isfinite(xf)
    clipped = ((xf < lo) | (xf > hi)) & finite
    return clipped.sum().item() / max(finite.sum().item(), 1)
