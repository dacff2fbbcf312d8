"""Element formats: grids from bit layouts, and exact reference rounding.

The references here never read `fmt.grid` or call the library's rounding: they decode every bit
pattern of the layout and pick the nearest value by brute force in float64.
"""

import math

import pytest
import torch

from minifloat import formats

FLOAT_LAYOUTS = {  # name: (ebits, mbits, bias, which codes are not finite numbers)
    "e2m1": (2, 1, 1, "none"),
    "e1m2": (1, 2, 1, "none"),
    "e3m0": (3, 0, 3, "none"),
    "e4m3": (4, 3, 7, "fn"),  # only S.1111.111 is NaN
    "e5m2": (5, 2, 15, "ieee"),  # exponent all-ones is inf/NaN
}


def decode(code: int, ebits: int, mbits: int, bias: int, special: str) -> float | None:
    """Value of a non-negative bit pattern, straight from the layout (None: not a number)."""
    e = code >> mbits
    m = code & ((1 << mbits) - 1)
    top = (1 << ebits) - 1
    if special == "ieee" and e == top:
        return None
    if special == "fn" and e == top and m == (1 << mbits) - 1:
        return None
    if e == 0:
        return m * 2.0 ** (1 - bias - mbits)
    return 2.0 ** (e - bias) * (1 + m / (1 << mbits))


INT_BITS = {"int8": 8, "int4": 4}


def decode_int(code: int, bits: int) -> int | None:
    """Two's-complement value of a bit pattern (None: the most negative code, which a symmetric
    grid leaves unused)."""
    value = code - (1 << bits) if code >> (bits - 1) else code
    return None if value == -(1 << (bits - 1)) else value


def layout_values(name: str) -> dict[int, float]:
    """Every bit pattern of `name` that encodes a finite number, mapped to its value."""
    if name in INT_BITS:
        bits = INT_BITS[name]
        pairs = [(c, decode_int(c, bits)) for c in range(1 << bits)]
    else:
        ebits, mbits, bias, special = FLOAT_LAYOUTS[name]
        sign = 1 << (ebits + mbits)  # sign-magnitude: the top bit only negates
        pairs = [(c, decode(c, ebits, mbits, bias, special)) for c in range(sign)]
        pairs += [(c | sign, None if v is None else -v) for c, v in pairs]
    return {c: float(v) for c, v in pairs if v is not None}


def test_layouts_cover_every_format():
    assert set(FLOAT_LAYOUTS) | set(INT_BITS) == set(formats.names())


@pytest.mark.parametrize("name", formats.names())
def test_grid_matches_bit_layout(name):
    values = set(layout_values(name).values())
    fmt = formats.get(name)
    assert fmt.grid.tolist() == sorted({abs(v) for v in values})
    assert fmt.max == max(values)
    # The grid is symmetric: every magnitude is representable with both signs (int formats
    # drop the most negative code to get there).
    assert values | {-v for v in values} == values | {0.0}
    if name in INT_BITS:  # every code but the most negative one is a distinct number
        assert len(layout_values(name)) == len(values) == (1 << INT_BITS[name]) - 1


def test_known_grids_and_maxima():
    assert formats.get("e2m1").grid.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert formats.get("e4m3").max == 448.0
    assert formats.get("e5m2").max == 57344.0
    assert formats.get("int8").max == 127 and formats.get("int4").grid.tolist() == list(range(8))


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_float8_grid_matches_torch_dtype(name):
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[name]
    as_float = torch.arange(0, 128, dtype=torch.uint8).view(dtype).float()
    finite = as_float[torch.isfinite(as_float)]
    assert sorted(set(finite.tolist())) == formats.get(name).grid.tolist()


def reference_round_nearest_even(x: torch.Tensor, name: str) -> torch.Tensor:
    """Independent float64 rounding by brute force over the layout's bit patterns.

    Each magnitude goes to the code whose value is nearest; on an exact tie, to the code whose
    least significant bit is 0 (for minifloats that bit is the mantissa's LSB, or the exponent's
    when there is no mantissa; for ints it is the integer's parity). Magnitudes beyond the
    largest value saturate to it; the sign is copied back; NaN stays NaN.
    """
    codes = {c: v for c, v in layout_values(name).items() if v > 0 or c == 0}
    vals = torch.tensor(list(codes.values()), dtype=torch.float64)
    lsb = torch.tensor([c & 1 for c in codes], dtype=torch.int64)
    mag = x.double().abs().clamp(max=vals.max().item())  # saturate (also ±inf); NaN passes
    dist = (mag[:, None] - vals[None, :]).abs()  # exact where a tie is possible
    nearest = dist == dist.min(dim=1, keepdim=True).values
    # Among the nearest codes (one, or two on a tie) take the one with an even LSB.
    pick = torch.where(nearest, lsb[None, :], torch.full_like(dist, 2, dtype=torch.int64))
    out = vals[pick.argmin(dim=1)]
    out = torch.where(torch.isnan(x), torch.full_like(out, math.nan), out)
    return torch.copysign(out, x.double())


def adversarial(fmt: formats.ElementFormat) -> torch.Tensor:
    """Grid points, exact midpoints (ties), just-off-midpoints, beyond max, tiny, zero, inf."""
    g = fmt.grid.double()
    mids = (g[1:] + g[:-1]) / 2
    eps = 1e-6 * torch.ones_like(mids)
    vals = torch.cat([g, mids, mids + eps, mids - eps, torch.tensor([fmt.max * 1.01, fmt.max * 1e3,
                      1e-30, 1e-45, 0.0, math.inf])])  # fmt: skip
    vals = torch.cat([vals, -vals])
    return vals.float()


@pytest.mark.parametrize("name", formats.names())
def test_nearest_even_matches_independent_reference(name):
    fmt = formats.get(name)
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([adversarial(fmt), torch.randn(20000, generator=gen) * fmt.max / 3])
    x = torch.cat([x, torch.tensor([math.nan])])
    got = fmt.round(x)
    want = reference_round_nearest_even(x, name).float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert torch.equal(got[ok], want[ok])


# E3M0 has no mantissa, so ties go to the even exponent field. Codes 0..7 are
# 0, 0.25, 0.5, 1, 2, 4, 8, 16: code 2k is the even one. Written out by hand.
E3M0_TIES = {
    0.125: 0.0,  # 0 (code 0) vs 0.25 (code 1)
    0.375: 0.5,  # 0.25 (code 1) vs 0.5 (code 2)
    0.75: 0.5,  # 0.5 (code 2) vs 1 (code 3)
    1.5: 2.0,  # 1 (code 3) vs 2 (code 4)
    3.0: 2.0,  # 2 (code 4) vs 4 (code 5)
    6.0: 8.0,  # 4 (code 5) vs 8 (code 6)
    12.0: 8.0,  # 8 (code 6) vs 16 (code 7)
}


def test_e3m0_ties_go_to_even_exponent():
    x = torch.tensor(list(E3M0_TIES))
    want = torch.tensor(list(E3M0_TIES.values()))
    fmt = formats.get("e3m0")
    assert torch.equal(fmt.round(x), want)
    assert torch.equal(fmt.round(-x), -want)
    assert torch.equal(reference_round_nearest_even(x, "e3m0").float(), want)
    # Just off each tie, the nearer neighbour wins whatever its parity.
    lo = torch.tensor([0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0])
    assert torch.equal(fmt.round(x * (1 - 2**-20)), lo)
    assert torch.equal(fmt.round(x * (1 + 2**-20)), lo * 2 + (lo == 0) * 0.25)


@pytest.mark.parametrize(
    ("name", "dtype"), [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)]
)
def test_nearest_even_matches_torch_float8_cast(name, dtype):
    fmt = formats.get(name)
    gen = torch.Generator().manual_seed(1)
    x = torch.cat([adversarial(fmt), torch.randn(50000, generator=gen) * fmt.max / 4])
    x = x[torch.isfinite(x) & (x.abs() <= fmt.max)]  # torch's cast doesn't saturate beyond max
    assert torch.equal(fmt.round(x), x.to(dtype).float())


def test_stochastic_rounding_unbiased_and_on_grid():
    fmt = formats.get("e2m1")
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(1_000_000, generator=gen) * 12 - 6
    q = fmt.round(x, "stochastic", torch.Generator().manual_seed(1))
    assert bool(fmt.is_on_grid(q).all())
    # Each error is bounded by the local spacing (<= 2), so the mean error has std <= 2/sqrt(n).
    # Per sign: a rounding biased toward zero (or away) on both sides would cancel in one mean.
    for side in (x > 0, x < 0):
        bias = (q - x)[side].double().mean().item()
        assert abs(bias) < 5 * 2 / math.sqrt(int(side.sum()))
    # ... while nearest rounding of the same data is not what stochastic gives.
    assert not torch.equal(q, fmt.round(x))


def test_stochastic_rounding_deterministic_for_generator():
    fmt = formats.get("e4m3")
    x = torch.randn(1000) * 10
    a = fmt.round(x, "stochastic", torch.Generator().manual_seed(7))
    b = fmt.round(x, "stochastic", torch.Generator().manual_seed(7))
    c = fmt.round(x, "stochastic", torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_round_refuses_both_generator_and_noise():
    x = torch.randn(8)
    with pytest.raises(ValueError, match="generator or noise, not both"):
        formats.get("e2m1").round(x, "stochastic", torch.Generator(), noise=torch.rand(8))


def test_stochastic_keeps_grid_points_exact():
    fmt = formats.get("e2m1")
    g = fmt.grid.float()
    x = torch.cat([g, -g]).repeat(100)
    assert torch.equal(fmt.round(x, "stochastic", torch.Generator().manual_seed(0)), x)


def test_unknown_names_list_valid_ones():
    with pytest.raises(ValueError, match="e2m1"):
        formats.get("fp5")
    with pytest.raises(ValueError, match="e8m0"):
        formats.get_scale_format("fp7")
    with pytest.raises(ValueError, match="nearest"):
        formats.get("e2m1").round(torch.ones(2), "up")


def test_pow2_ceil_exact():
    x = torch.tensor([1.0, 1.5, 2.0, 3.0, 0.375, 2.0**-130, 1e30])
    got = formats.pow2_ceil(x)
    want = torch.tensor([2.0 ** math.ceil(math.log2(v)) for v in x.double().tolist()])
    assert torch.equal(got, want.float())


@pytest.mark.parametrize("name", formats.names())
def test_below_max_is_the_grid_point_under_max(name):
    fmt = formats.get(name)
    assert fmt.below_max == fmt.grid[-2].item()


def _spacing_frexp_ldexp(fmt, mag: torch.Tensor) -> torch.Tensor:
    """The spacing by frexp/ldexp: the definition that the bit-read form must equal."""
    _, exp = torch.frexp(mag)
    e = torch.where(mag == 0, fmt.emin, torch.clamp(exp - 1, min=fmt.emin))
    return torch.ldexp(torch.ones_like(mag), (e - fmt.mbits).to(torch.int32))


@pytest.mark.parametrize("name", list(FLOAT_LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_spacing_from_bits_equals_frexp_ldexp(name, dtype):
    """`spacing` and `spacings` read float32/float64 exponent fields; both equal the
    frexp/ldexp powers of two (and each other's reciprocal) for zeros, float subnormals, grid
    points, their neighbours, midpoints and finite magnitudes far above max."""
    fmt = formats.get(name)
    info = torch.finfo(dtype)
    grid = fmt.grid.to(dtype)
    mids = (grid[1:] + grid[:-1]) / 2
    special = torch.tensor([0.0, info.tiny, info.tiny / 4, 1e-30, fmt.max, 1e30, info.max],
                           dtype=dtype)  # fmt: skip
    rand = torch.rand(5000, dtype=dtype, generator=torch.Generator().manual_seed(0)) * fmt.max
    mag = torch.cat([grid, mids, grid * (1 + info.eps), grid * (1 - info.eps / 2), special, rand])
    want = _spacing_frexp_ldexp(fmt, mag)
    got = fmt.spacing(mag)
    assert got.dtype == dtype and torch.equal(got, want)
    below = mag[mag < 2.0**100]
    quantum, inv = fmt.spacings(below)
    assert torch.equal(quantum, _spacing_frexp_ldexp(fmt, below))
    assert torch.equal(inv, _spacing_frexp_ldexp(fmt, below).reciprocal())
    low = mag.bfloat16()  # other dtypes: the frexp/ldexp form
    assert torch.equal(fmt.spacing(low), _spacing_frexp_ldexp(fmt, low))


@pytest.mark.parametrize("name", list(FLOAT_LAYOUTS))
def test_spacing_of_inf_and_nan_is_finite(name):
    """The bit-read exponent is capped: inf and NaN magnitudes give finite powers of two."""
    fmt = formats.get(name)
    mag = torch.tensor([float("inf"), float("nan")])
    assert all(torch.isfinite(p).all() for p in fmt.spacings(mag))


@pytest.mark.parametrize("name", list(INT_BITS))
def test_int_spacing_is_one(name):
    fmt = formats.get(name)
    mag = torch.tensor([0.0, 1.0, fmt.max])
    assert torch.equal(fmt.spacing(mag), torch.ones(3))
    assert all(torch.equal(p, torch.ones(3)) for p in fmt.spacings(mag))


@pytest.mark.parametrize(
    "noise",
    [torch.rand(1), torch.rand(2, 4), torch.zeros(4, dtype=torch.int64)],
    ids=["one", "broadcast", "int"],
)
def test_round_refuses_noise_not_of_x_shape(noise):
    # broadcast, one uniform rounded every entry alike (or grew the output's shape)
    with pytest.raises(ValueError, match="noise must be a floating tensor of x's shape"):
        formats.get("e2m1").round(torch.full((4,), 0.7), "stochastic", noise=noise)


@pytest.mark.parametrize("fmt_max", [0.0, -6.0, math.inf, math.nan, "e2m1"])
def test_scale_helpers_refuse_bad_fmt_max(fmt_max):
    with pytest.raises(ValueError, match="fmt_max must be a finite number > 0"):
        formats.e8m0_max(fmt_max)
    with pytest.raises(ValueError, match="fmt_max must be a finite number > 0"):
        formats.inv_scales(torch.tensor([3.0]), fmt_max)


def test_represent_scale_takes_a_scale_format_name():
    raw = torch.tensor([3.0])
    got = formats.represent_scale(raw, "pow2", torch.tensor(1.0), 6.0)
    assert torch.equal(got, formats.represent_scale(raw, formats.SCALE_FORMATS["pow2"], raw, 6.0))
