"""quantize / fake_quantize / QTensor: scales per granularity, non-finite handling, errors."""

import inspect
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

import minifloat
from minifloat import formats
from minifloat.quantize import _quantiles, group_amax, quantize, tensor_quantiles
from tolerances import FAKE_QUANTIZE_SQNR_FLOOR_DB, NVFP4_TWO_LEVEL_MIN_DB

SHAPES = [(7,), (300,), (5, 33), (129, 131), (3, 130, 257), (256, 128)]
GRANULARITIES = ["tensor", "row", "column", (1, 16), (1, 32), (1, 128), (16, 16), (128, 128)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SCALE_FORMATS = ["fp32", "pow2", "e8m0", "e4m3", "inv"]

# q.scale.shape for every shape x granularity, written out by hand: one entry per group,
# ceil-divided for ragged blocks; a 1-D input is one row (column granularity rejects it).
EXPECTED_SCALE_SHAPES = {
    (7,): [(1,), (1,), None, (1, 1), (1, 1), (1, 1), (1, 1), (1, 1)],
    (300,): [(1,), (1,), None, (1, 19), (1, 10), (1, 3), (1, 19), (1, 3)],
    (5, 33): [(1, 1), (5, 1), (1, 33), (5, 3), (5, 2), (5, 1), (1, 3), (1, 1)],
    (129, 131): [(1, 1), (129, 1), (1, 131), (129, 9), (129, 5), (129, 2), (9, 9), (2, 2)],
    (3, 130, 257): [
        (1, 1, 1),
        (3, 130, 1),
        (3, 1, 257),
        (3, 130, 17),
        (3, 130, 9),
        (3, 130, 3),
        (3, 9, 17),
        (3, 2, 3),
    ],
    (256, 128): [(1, 1), (256, 1), (1, 128), (256, 8), (256, 4), (256, 1), (16, 8), (2, 1)],
}


def expected_scale_shape(shape, granularity):
    return EXPECTED_SCALE_SHAPES[shape][GRANULARITIES.index(granularity)]


def group_ids(shape, granularity) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Group index of every element (x's shape), from element coordinates rather than padding
    and reshaping, and the (batch, group rows, group cols) layout of the ids."""
    rows, cols = (1, shape[0]) if len(shape) == 1 else shape[-2:]
    batch = math.prod(shape[:-2])
    if granularity == "tensor":
        return torch.zeros(shape, dtype=torch.long), (1, 1, 1)
    br, bc = {"row": (1, cols), "column": (rows, 1)}.get(granularity, granularity)
    nr, nc = -(-rows // br), -(-cols // bc)
    b = torch.arange(batch)[:, None, None]
    r = torch.arange(rows)[None, :, None] // br
    c = torch.arange(cols)[None, None, :] // bc
    return ((b * nr + r) * nc + c).reshape(shape), (batch, nr, nc)


def reference_scales(x: torch.Tensor, granularity, fmt_max: float, scale_format: str):
    """Group scales in float64, one group at a time semantically (scatter by group index).

    Float32 quantities are obtained by rounding an exact or float64 result once: for a quotient
    or product of two float32 numbers that equals float32 arithmetic (53 >= 2 * 24 + 2 bits, so
    the double rounding is innocuous). Returns the compact (batch, group rows, group cols)
    scales and the ids that map each element to its group.
    """
    ids, layout = group_ids(tuple(x.shape), granularity)
    mag = x.double().abs().flatten()
    if granularity == "tensor":  # (scatter_reduce into a single slot is slow on CPU)
        amax = mag.max().reshape(1)
    else:
        amax = torch.zeros(math.prod(layout), dtype=torch.float64)
        amax = amax.scatter_reduce(0, ids.flatten(), mag, "amax")
    raw = torch.where(amax > 0, amax / fmt_max, 1.0).float().clamp(min=2.0**-149).double()
    if scale_format == "inv":  # 1 / m, m = fmt_max / amax in float32, at most 2^126
        m = reference_multipliers(amax, fmt_max)
        return (1 / m.double()).float().reshape(layout), ids
    if scale_format in ("pow2", "e8m0"):
        scale = torch.exp2(torch.ceil(torch.log2(raw))).clamp(max=2.0**127)
        if scale_format == "e8m0":  # fmt_max * scale < 2^128: at most 2^(127 - emax)
            top = 2.0 ** min(127, 127 - math.floor(math.log2(fmt_max)))
            scale = scale.clamp(min=2.0**-127, max=top)
    elif scale_format == "e4m3":
        tensor_scale = (amax.max() / (fmt_max * 448)).float().double()
        if tensor_scale == 0:
            tensor_scale = torch.tensor(1.0, dtype=torch.float64)
        block = (raw / tensor_scale).float().to(torch.float8_e4m3fn).double()
        scale = block.clamp(min=2.0**-9) * tensor_scale
    else:
        scale = raw
    scale = torch.where(amax > 0, scale.float(), 1.0)
    return scale.reshape(layout), ids


def reference_multipliers(amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """The "inv" format's float32 multipliers of float64 group maxima (amax: [groups])."""
    m = (fmt_max / amax.clamp(min=fmt_max * 2.0**-126)).float()
    return torch.where(amax > 0, m, 1.0)


FLOAT8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def reference_round(scaled: torch.Tensor, fmt: formats.ElementFormat) -> torch.Tensor:
    """Nearest-even rounding onto the grid, saturating at max (NaN-free input), by a route
    other than the library's: torch's own float8 cast for E4M3/E5M2, else the nearest grid value
    by brute-force float64 distance, ties to the even grid index (fine for 16-entry grids)."""
    mag = scaled.double().abs().clamp(max=fmt.max)
    if fmt.name in FLOAT8_DTYPES:
        out = mag.float().to(FLOAT8_DTYPES[fmt.name]).double()
    else:
        g = fmt.grid.double()
        even = torch.arange(len(g)) % 2 == 0
        dist = (mag.flatten()[:, None] - g[None, :]).abs()
        nearest = dist == dist.min(dim=1, keepdim=True).values
        # a tie has two nearest entries, one at an even index; otherwise there is just one
        tie = nearest.sum(1) > 1
        pick = torch.where(tie, (nearest & even).int().argmax(1), nearest.int().argmax(1))
        out = g[pick].reshape(mag.shape)
    return torch.copysign(out, scaled.double()).float()


def with_zero_groups(x: torch.Tensor) -> torch.Tensor:
    """x with all-zero rows (incl. a whole 16-row band), an all-zero column and, for 1-D, an
    all-zero leading run, so every granularity meets all-zero groups."""
    x = x.clone()
    if x.dim() == 1:
        x[:40] = 0
        return x
    rows = x.shape[-2]
    x[..., [0, rows - 1], :] = 0
    if rows >= 32:
        x[..., 16:32, :] = 0
    x[..., :, 1] = 0
    return x


def sample(shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen).pow(4) * 10
    return with_zero_groups(x)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_scale_shape_per_granularity(shape, granularity):
    x = torch.randn(shape)
    want = expected_scale_shape(shape, granularity)
    if want is None:
        with pytest.raises(ValueError, match="column"):
            quantize(x, "e2m1", granularity)
        return
    q = quantize(x, "e2m1", granularity)
    assert tuple(q.scale.shape) == want
    assert q.values.shape == x.shape and q.expand_scale().shape == x.shape
    if not isinstance(granularity, tuple):  # named granularities broadcast against x
        assert torch.equal(q.scale.expand(x.shape), q.expand_scale())


VALID_CASES = [
    (shape, g) for shape in SHAPES for g in GRANULARITIES if expected_scale_shape(shape, g)
]


@pytest.mark.parametrize(("shape", "granularity"), VALID_CASES)
@pytest.mark.parametrize(
    ("fmt", "scale_format"), [("e2m1", sf) for sf in SCALE_FORMATS] + [("e4m3", "fp32")]
)
def test_scales_and_values_match_float64_reference(shape, granularity, fmt, scale_format):
    seed = SHAPES.index(shape) * 100 + GRANULARITIES.index(granularity)
    x = sample(shape, seed)
    f = formats.get(fmt)
    q = quantize(x, fmt, granularity, scale_format=scale_format)
    want, ids = reference_scales(x, granularity, f.max, scale_format)
    # Exact: the compact scales, group by group, and their per-element expansion.
    assert torch.equal(q.scale, want.reshape(expected_scale_shape(shape, granularity)))
    assert torch.equal(q.expand_scale(), want.flatten()[ids])
    # All-zero groups get scale 1 (make sure the data has some where the layout allows).
    zero_groups = group_amax(x, granularity) == 0
    assert torch.equal(q.scale[zero_groups], torch.ones(int(zero_groups.sum())))
    if len(shape) > 1 and granularity in ("row", "column", (1, 16), (1, 32), (1, 128)):
        assert bool(zero_groups.any())
    if len(shape) > 1 and shape[-2] >= 32 and granularity == (16, 16):
        assert bool(zero_groups.any())
    # Values are the float64 nearest-even rounding of the float32 quotient x / scale, or with
    # "inv" scales of the float32 product x * m.
    if scale_format == "inv":
        amax = group_amax(x, granularity).double().flatten()
        m = reference_multipliers(amax, f.max).double()
        ids = group_ids(tuple(x.shape), granularity)[0]
        scaled = (x.double() * m[ids]).float()
    else:
        scaled = (x.double() / want.flatten()[ids].double()).float()
    assert torch.equal(q.values, reference_round(scaled, f))
    if scale_format in ("fp32", "inv"):  # each nonzero group's largest magnitude lands on max
        top = group_amax(q.values, granularity)
        assert torch.equal(top[~zero_groups], torch.full_like(top[~zero_groups], f.max))


@pytest.mark.parametrize(
    ("fmt", "dtype"), [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)]
)
@pytest.mark.parametrize("granularity", ["tensor", "row", "column", (1, 32), (16, 16)])
@pytest.mark.parametrize("scale_format", ["fp32", "pow2", "e8m0"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_float8_values_equal_torch_cast_of_scaled_input(
    fmt, dtype, granularity, scale_format, x_dtype
):
    x = sample((129, 131), seed=7).to(x_dtype)
    q = quantize(x, fmt, granularity, scale_format=scale_format)
    scaled = x.float() / q.expand_scale()
    in_range = scaled.abs() <= formats.get(fmt).max  # torch's cast doesn't saturate
    assert in_range.float().mean() > 0.99  # most entries are compared (measured >= 99.7%)
    assert torch.equal(q.values[in_range], scaled[in_range].to(dtype).float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2", "int8"])
def test_fake_quantize_dtype_and_error(dtype, fmt):
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)).to(dtype)
    y = minifloat.fake_quantize(x, fmt, "row")
    assert y.dtype == dtype and y.shape == x.shape
    sqnr = 20 * math.log10(x.float().norm() / (y.float() - x.float()).norm())
    assert sqnr > FAKE_QUANTIZE_SQNR_FLOOR_DB[fmt]


def test_fake_quantize_signature_matches_quantize():
    fq = inspect.signature(minifloat.fake_quantize).parameters
    q = inspect.signature(quantize).parameters
    assert list(fq.values()) == list(q.values())
    assert not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in fq.values())
    assert all(p.annotation is not inspect.Parameter.empty for p in fq.values())


def test_fake_quantize_passes_every_argument_on():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2)) * 3
    kw = dict(scale_format="pow2", rounding="stochastic", clip_quantile=0.99)
    got = minifloat.fake_quantize(
        x, "e2m1", (1, 16), generator=torch.Generator().manual_seed(5), **kw
    )
    q = quantize(x, "e2m1", (1, 16), generator=torch.Generator().manual_seed(5), **kw)
    assert torch.equal(got, q.dequantize())
    assert not torch.equal(got, minifloat.fake_quantize(x, "e2m1", (1, 16)))


def test_all_zero_groups_get_unit_scale():
    x = torch.zeros(4, 8)
    x[1] = torch.arange(8.0)
    q = quantize(x, "e2m1", "row")
    assert q.scale[0].item() == 1.0 and q.scale[2].item() == 1.0
    assert torch.equal(q.values[0], torch.zeros(8))
    assert q.scale[1].item() == pytest.approx(7 / 6)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("granularity", ["tensor", "row", (1, 4)])
def test_non_finite_group_becomes_nan(bad, granularity):
    x = torch.randn(4, 8)
    x[2, 5] = bad
    q = quantize(x, "e2m1", granularity)
    d = q.dequantize()
    if granularity == "tensor":
        assert bool(torch.isnan(d).all())
    elif granularity == "row":
        assert bool(torch.isnan(d[2]).all()) and bool(torch.isfinite(d[[0, 1, 3]]).all())
    else:
        assert bool(torch.isnan(d[2, 4:]).all()) and bool(torch.isfinite(d[2, :4]).all())
    assert int(torch.isnan(d).sum()) >= 1


@pytest.mark.parametrize("scale_format", ["pow2", "e8m0"])
def test_power_of_two_scales_never_overflow(scale_format):
    x = torch.randn(32, 64) * 100
    q = quantize(x, "e2m1", (1, 32), scale_format=scale_format)
    mant, _ = torch.frexp(q.scale)
    assert bool((mant == 0.5).all())  # powers of two
    assert bool(((x / q.expand_scale()).abs() <= 6).all())  # nothing clipped by the grid
    assert bool((q.scale >= group_amax(x, (1, 32)) / 6).all())


def test_e8m0_scale_range_clamped():
    x = torch.full((2, 32), 1e-38)
    q = quantize(x, "e2m1", (1, 32), scale_format="e8m0")
    assert bool((q.scale >= 2.0**-127).all())


def test_nvfp4_two_level_scale():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 64, generator=gen) * torch.logspace(-2, 2, 64)
    q = quantize(x, "e2m1", (1, 16), scale_format="e4m3")
    tensor_scale = x.abs().max() / (6 * 448)
    block = q.scale / tensor_scale
    # q.scale is an E4M3 value times the tensor scale: dividing it back rounds (<= 2^-23 relative)
    assert torch.allclose(formats.get("e4m3").round(block), block, rtol=1e-6)
    sqnr = 20 * math.log10(x.norm() / (q.dequantize() - x).norm())
    assert sqnr > NVFP4_TWO_LEVEL_MIN_DB


@pytest.mark.parametrize("granularity", ["row", (1, 32)])
def test_stochastic_quantize_unbiased_and_reproducible(granularity):
    x = torch.randn(200, 5000, generator=torch.Generator().manual_seed(0))
    kw = dict(rounding="stochastic")
    a = quantize(x, "e2m1", granularity, generator=torch.Generator().manual_seed(1), **kw)
    b = quantize(x, "e2m1", granularity, generator=torch.Generator().manual_seed(1), **kw)
    assert torch.equal(a.values, b.values)
    err = (a.dequantize() - x).double()
    spacing = (2 * a.expand_scale()).double()
    # Each error is bounded by spacing x scale, so the mean must vanish like 1/sqrt(n), on each
    # sign separately (a bias toward or away from zero cancels in the mean over both signs).
    for side in (x > 0, x < 0):
        bound = 5 * spacing[side].pow(2).mean().sqrt() / math.sqrt(int(side.sum()))
        assert abs(err[side].mean().item()) < bound.item()


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 4099])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("select", ["sort", "kthvalue"])
def test_quantiles_by_sort_and_by_selection_match_torch_quantile(n, ties, select):
    # The sort path is what CUDA uses; on CPU it must give the very same values as kthvalue.
    g = torch.Generator().manual_seed(n)
    flat = torch.randn(n, generator=g)
    if ties:
        flat = flat.round()  # many equal values, including both zeros
    qs = (0.01, 0.03, 0.5, 0.97, 0.99)
    got = torch.stack(_quantiles(flat, qs, select=select))
    other = torch.stack(_quantiles(flat, qs, select={"sort": "kthvalue"}.get(select, "sort")))
    # bit-exact up to the sign of a zero quantile (the paths may pick -0.0 or 0.0)
    assert torch.equal(got.abs().view(torch.int32), other.abs().view(torch.int32))
    # torch.quantile interpolates between the same order statistics with another formula: an
    # ulp or two of values < 4 (measured 2.4e-7); no summation is involved
    torch.testing.assert_close(got, torch.quantile(flat, torch.tensor(qs)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "extra",
    [
        [float("nan")],
        [float("inf"), float("-inf")],
        [float("-inf")] * 3 + [float("nan"), float("inf")] * 2,
    ],
)
def test_quantiles_ignore_non_finite_entries_on_both_paths(extra):
    g = torch.Generator().manual_seed(1)
    finite = torch.randn(501, generator=g)
    flat = torch.cat([finite, torch.tensor(extra)])[torch.randperm(501 + len(extra), generator=g)]
    qs = (0.01, 0.5, 0.99)
    want = torch.stack(_quantiles(finite, qs, select="kthvalue"))
    for select in ("sort", "kthvalue"):
        got = torch.stack(_quantiles(flat, qs, select=select))
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), select  # bit-exact


@pytest.mark.parametrize("select", ["sort", "kthvalue"])
@pytest.mark.parametrize("flat", [[], [float("nan"), float("inf")], [float("-inf")] * 4])
def test_quantiles_without_finite_entries_are_nan(select, flat):
    got = _quantiles(torch.tensor(flat), (0.01, 0.99), select=select)
    assert all(bool(torch.isnan(v)) for v in got)


def test_quantiles_compile_without_graph_breaks_and_match_eager():
    # Under torch.compile "auto" takes the sort path, whose shapes are all static.
    flat = torch.cat([torch.randn(1000), torch.tensor([float("nan"), float("-inf")])])
    compiled = torch.compile(lambda f: _quantiles(f, (0.01, 0.99)), fullgraph=True)
    got = torch.stack(compiled(flat))
    assert torch.equal(got, torch.stack(_quantiles(flat, (0.01, 0.99), select="kthvalue")))


def test_quantiles_reject_unknown_selection():
    with pytest.raises(ValueError, match="select"):
        _quantiles(torch.randn(10), (0.5,), select="median")


def student_t3(shape, seed: int) -> torch.Tensor:
    """Student-t (3 dof) from an explicit generator: normal / sqrt(chi2_3 / 3)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=gen)
    chi2 = torch.randn((3, *shape), generator=gen).pow(2).sum(0)
    return z / (chi2 / 3).sqrt()


def test_clip_quantile_clamps_two_sided_and_keeps_non_finite():
    x = student_t3((100, 100), seed=0)
    lo, hi = tensor_quantiles(x, 0.99)
    tq = torch.quantile(x.flatten(), torch.tensor([0.01, 0.99]))
    assert torch.allclose(torch.stack([lo, hi]), tq, rtol=1e-5)  # as above (measured 9.5e-7)
    q = quantize(x, "e2m1", "tensor", clip_quantile=0.99)
    # Clipping then quantizing is quantizing the clamped tensor; the absmax scale is set by
    # the larger of |lo| and hi, so no dequantized value lies beyond it.
    assert torch.equal(q.values, quantize(x.clamp(lo, hi), "e2m1", "tensor").values)
    bound = torch.maximum(lo.abs(), hi.abs())
    assert q.dequantize().abs().max() <= bound * (1 + 1e-6)  # scale * 6: a rounding or two
    assert q.dequantize().abs().max() < x.abs().max() / 2  # the tails really were clipped
    x[0, 0] = math.inf
    assert bool(torch.isnan(quantize(x, "e2m1", "row", clip_quantile=0.99).values[0]).all())


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(fmt="fp3"), ValueError, "e2m1"),
        (dict(fmt="e2m1", granularity="block"), ValueError, "tensor"),
        (dict(fmt="e2m1", granularity=(0, 32)), ValueError, "block"),
        (dict(fmt="e2m1", granularity=(True, 16)), ValueError, "'tensor', 'row', 'column'"),
        (dict(fmt="e2m1", granularity=(16, False)), ValueError, r"\(16, 16\)"),
        (dict(fmt="e2m1", granularity=(1, 16, 1)), ValueError, "block shape"),
        (dict(fmt="e2m1", granularity=(1.0, 16)), ValueError, "block shape"),
        (dict(fmt="e2m1", clip_quantile=0.3), ValueError, r"\(0\.5, 1\)"),
        (dict(fmt="e2m1", clip_quantile=1.0), ValueError, r"\(0\.5, 1\)"),
        (dict(fmt="e2m1", clip_quantile=math.nan), ValueError, r"\(0\.5, 1\)"),
        (dict(fmt="e2m1", clip_quantile="0.9"), TypeError, r"real number .*\(0\.5, 1\)"),
        (dict(fmt="e2m1", clip_quantile=True), TypeError, r"real number .*\(0\.5, 1\)"),
        (dict(fmt="e2m1", clip_quantile=torch.tensor(0.9)), TypeError, r"\(0\.5, 1\)"),
        (dict(fmt="e2m1", rounding="down"), ValueError, "stochastic"),
        (dict(fmt="e2m1", scale_format="fp16"), ValueError, "pow2"),
        (dict(fmt="e2m1", noise=torch.rand(4, 4)), ValueError, "for rounding='stochastic'"),
        (dict(fmt="e2m1", generator=torch.Generator()), ValueError, "'nearest' draws none"),
        (dict(fmt="e2m1", rounding="stochastic", generator=0), TypeError, "torch.Generator"),
        (dict(fmt="e2m1", rounding="stochastic", noise=torch.rand(1)), ValueError, "x's shape"),
        (dict(fmt="e2m1", rounding="stochastic", noise=torch.rand(4, 5)), ValueError, r"\(4, 5\)"),
        (
            dict(
                fmt="e2m1",
                rounding="stochastic",
                noise=torch.rand(4, 4),
                generator=torch.Generator(),
            ),
            ValueError,
            "generator or noise, not both",
        ),
        (
            dict(fmt="e2m1", rounding="stochastic", noise=torch.ones(4, 4, dtype=torch.int64)),
            TypeError,
            "noise must be a floating-point tensor",
        ),
    ],
)
@pytest.mark.parametrize("fn", [quantize, minifloat.fake_quantize])
def test_bad_arguments(fn, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fn(torch.randn(4, 4), **kwargs)


def test_clip_quantile_accepts_any_real_number():
    x = student_t3((64, 64), seed=1)
    want = quantize(x, "e2m1", "row", clip_quantile=0.99)
    for alpha in (np.float64(0.99), Fraction(99, 100)):
        q = quantize(x, "e2m1", "row", clip_quantile=alpha)
        assert torch.equal(q.values, want.values) and torch.equal(q.scale, want.scale)


@pytest.mark.parametrize("granularity", ["tensor", "row", (1, 128)], ids=str)
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2"])
def test_inv_scales_quantize_as_fp32_scales_but_next_to_rounding_boundaries(fmt, granularity):
    # "inv" multiplies by the float32 max / amax where fp32 divides by amax / max: the scales
    # differ by at most an ulp, and a value only where x / scale lies within an ulp or two of
    # a rounding boundary, moving to the neighbouring grid point. With bf16 inputs those are
    # mostly exact ties of max * x / amax (8-bit x and amax), which each form's rounded scale
    # pushes to one side: measured 0 (tensor) to 3.7e-4 (E4M3 rows) of the values here.
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(512, 1024, generator=gen) * torch.randn(512, 1, generator=gen).exp()).to(
        torch.bfloat16
    )
    a = quantize(x, fmt, granularity, scale_format="fp32")
    b = quantize(x, fmt, granularity, scale_format="inv")
    assert ((b.scale.double() / a.scale.double() - 1).abs() <= 2.0**-23).all()
    differ = a.values != b.values
    assert differ.float().mean() < 1e-3
    grid = formats.get(fmt).grid.float()
    index = lambda v: torch.searchsorted(grid, v.abs().contiguous())  # noqa: E731
    assert ((index(a.values[differ]) - index(b.values[differ])).abs() <= 1).all()


@pytest.mark.parametrize("shape", [(64, 64), (3, 70, 50), (0, 64), (40,)])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_a_block_larger_than_the_data_is_the_data_sized_block(shape, fmt):
    """A block side beyond the data's is one group along it: the same values and scales as the
    block cut to the data, without padding the data out to the block (a block of 2**40
    columns tried to allocate 281 TB)."""
    x = torch.randn(shape) * 3
    rows = 1 if len(shape) == 1 else shape[-2]
    fitted = (max(1, min(16, rows)), shape[-1] or 1)
    huge = quantize(x, fmt, (16, 2**40))
    ref = quantize(x, fmt, fitted)
    assert torch.equal(huge.scale, ref.scale)
    assert torch.equal(huge.dequantize(), ref.dequantize())
    assert huge.dequantize().shape == x.shape


@pytest.mark.parametrize("granularity", ["tensor", "row", (1, 16)])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_fake_quantize_is_straight_through(fmt, granularity):
    """Rounding's derivative is zero: without the straight-through estimator a fake-quantized
    forward trained nothing (x.grad was all zeros). The values are the same bits either way."""
    x = (torch.randn(8, 32) * 3).requires_grad_()
    y = minifloat.fake_quantize(x, fmt, granularity)
    assert torch.equal(y.detach(), minifloat.fake_quantize(x.detach(), fmt, granularity))
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.equal(x.grad, dy)
    with torch.no_grad():
        assert not minifloat.fake_quantize(x, fmt, granularity).requires_grad
