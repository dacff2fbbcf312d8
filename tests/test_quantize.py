"""quantize / fake_quantize / QTensor: scales per granularity, non-finite handling, errors."""

import math

import pytest
import torch

import minifloat
from minifloat import formats
from minifloat.quantize import _quantiles, group_amax, quantize, tensor_quantiles

SHAPES = [(7,), (5, 33), (3, 130, 257), (256, 128)]
GRANULARITIES = ["tensor", "row", "column", (1, 16), (1, 32), (1, 128), (16, 16), (128, 128)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def loop_scales(x: torch.Tensor, granularity, fmt_max: float) -> torch.Tensor:
    """Per-element scale computed the slow, obvious way: one Python loop over groups."""
    x2 = x.double().reshape(-1, x.shape[-1]) if x.dim() > 1 else x.double().reshape(1, -1)
    lead = x.shape[:-2] if x.dim() > 2 else ()
    rows, cols = x2.shape[-2] if x.dim() <= 2 else x.shape[-2], x.shape[-1]
    mats = x2.reshape(-1, rows, cols)
    out = torch.empty_like(mats)
    if granularity == "tensor":
        groups = [(slice(None), slice(None), slice(None))]
    else:
        br, bc = {"row": (1, cols), "column": (rows, 1)}.get(granularity, granularity)
        groups = [
            (b, slice(r, r + br), slice(c, c + bc))
            for b in range(mats.shape[0])
            for r in range(0, rows, br)
            for c in range(0, cols, bc)
        ]
    for g in groups:
        amax = mats[g].abs().max().item()
        out[g] = (amax / fmt_max) if amax > 0 else 1.0
    return out.reshape(*lead, rows, cols).reshape(x.shape) if lead else out.reshape(x.shape)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
def test_scales_and_values_per_granularity(shape, granularity, fmt):
    if granularity == "column" and len(shape) == 1:
        pytest.skip("column granularity needs 2 dims")
    gen = torch.Generator().manual_seed(hash((shape, str(granularity))) % 1000)
    x = torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen).pow(4) * 10
    q = quantize(x, fmt, granularity)
    f = formats.get(fmt)
    # Scale values equal the slow per-group loop (float32 division of the float32 amax).
    want = loop_scales(x, granularity, f.max).float()
    assert torch.allclose(q.expand_scale(), want, rtol=1e-6, atol=0)
    # Values are the grid rounding of x / scale, and scales are broadcastable where promised.
    assert torch.equal(q.values, f.round(x.float() / q.expand_scale()))
    assert bool(f.is_on_grid(q.values).all())
    if not isinstance(granularity, tuple):
        assert torch.broadcast_shapes(q.scale.shape, x.shape) == x.shape
    # Each group's largest magnitude lands on the format's max.
    assert torch.allclose(group_amax(q.values, q.granularity).amax(), torch.tensor(f.max))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2", "int8"])
def test_fake_quantize_dtype_and_error(dtype, fmt):
    x = torch.randn(64, 96).to(dtype)
    y = minifloat.fake_quantize(x, fmt, "row")
    assert y.dtype == dtype and y.shape == x.shape
    sqnr = 20 * math.log10(x.float().norm() / (y.float() - x.float()).norm())
    floor = {"e2m1": 12.0, "e4m3": 28.0, "e5m2": 22.0, "int8": 35.0}[fmt]
    assert sqnr > floor


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
    assert torch.allclose(formats.get("e4m3").round(block), block, rtol=1e-6)
    sqnr = 20 * math.log10(x.norm() / (q.dequantize() - x).norm())
    assert sqnr > 15


@pytest.mark.parametrize("granularity", ["row", (1, 32)])
def test_stochastic_quantize_unbiased_and_reproducible(granularity):
    x = torch.randn(200, 5000, generator=torch.Generator().manual_seed(0))
    kw = dict(rounding="stochastic")
    a = quantize(x, "e2m1", granularity, generator=torch.Generator().manual_seed(1), **kw)
    b = quantize(x, "e2m1", granularity, generator=torch.Generator().manual_seed(1), **kw)
    assert torch.equal(a.values, b.values)
    err = (a.dequantize() - x).double()
    # Each error is bounded by spacing x scale, so the mean must vanish like 1/sqrt(n).
    bound = 5 * (2 * a.expand_scale()).double().pow(2).mean().sqrt() / math.sqrt(x.numel())
    assert abs(err.mean().item()) < bound.item()


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


def test_clip_quantile_clamps_two_sided_and_keeps_non_finite():
    gen = torch.Generator().manual_seed(0)
    x = torch.distributions.StudentT(3.0).sample((100, 100))
    lo, hi = tensor_quantiles(x, 0.99)
    tq = torch.quantile(x.flatten(), torch.tensor([0.01, 0.99]))
    assert torch.allclose(torch.stack([lo, hi]), tq, rtol=1e-5)
    q = quantize(x, "e2m1", "tensor", clip_quantile=0.99)
    assert q.dequantize().max() <= hi * (1 + 1e-6)
    x[0, 0] = math.inf
    assert bool(torch.isnan(quantize(x, "e2m1", "row", clip_quantile=0.99).values[0]).all())
    del gen


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(fmt="fp3"), ValueError, "e2m1"),
        (dict(fmt="e2m1", granularity="block"), ValueError, "tensor"),
        (dict(fmt="e2m1", granularity=(0, 32)), ValueError, "block"),
        (dict(fmt="e2m1", clip_quantile=0.3), ValueError, "0.5"),
        (dict(fmt="e2m1", rounding="down"), ValueError, "stochastic"),
        (dict(fmt="e2m1", scale_format="fp16"), ValueError, "pow2"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        quantize(torch.randn(4, 4), **kwargs)


def test_non_floating_input_is_type_error():
    with pytest.raises(TypeError, match="floating"):
        quantize(torch.arange(8), "e2m1")
