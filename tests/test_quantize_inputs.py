"""quantize's edge inputs: non-floating and 0-dim input, empty tensors, values near their dtype's
maximum, extreme group maxima, float64 beyond float32's range (test_quantize.py has the rest)."""

import math

import pytest
import torch

import minifloat
from minifloat import formats
from minifloat.quantize import quantize

SCALE_FORMATS = ["fp32", "pow2", "e8m0", "e4m3", "inv"]


def test_non_floating_input_is_type_error():
    with pytest.raises(TypeError, match="floating"):
        quantize(torch.arange(8), "e2m1")
    with pytest.raises(ValueError, match="at least one dimension"):
        quantize(torch.tensor(1.0), "e2m1")


# Empty inputs give empty values and the usual compact scale shapes (empty groups: scale 1).
EMPTY_SCALE_SHAPES = {
    (0, 4): {"tensor": (1, 1), "row": (0, 1), "column": (1, 4), (1, 16): (0, 1), (16, 16): (0, 1)},
    (4, 0): {"tensor": (1, 1), "row": (4, 1), "column": (1, 0), (1, 16): (4, 0), (16, 16): (1, 0)},
    (2, 0, 5): {
        "tensor": (1, 1, 1),
        "row": (2, 0, 1),
        "column": (2, 1, 5),
        (1, 16): (2, 0, 1),
        (16, 16): (2, 0, 1),
    },
    (0,): {"tensor": (1,), "row": (1,), (1, 16): (1, 0), (16, 16): (1, 0)},
}


@pytest.mark.parametrize(
    ("shape", "granularity"), [(s, g) for s, gs in EMPTY_SCALE_SHAPES.items() for g in gs]
)
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(scale_format="e4m3", clip_quantile=0.99),
        dict(rounding="stochastic", generator=torch.Generator().manual_seed(0)),
    ],
)
def test_empty_input_gives_empty_result(shape, granularity, kwargs):
    x = torch.empty(shape, dtype=torch.bfloat16)
    q = quantize(x, "e4m3", granularity, **kwargs)
    assert q.values.shape == x.shape and q.values.dtype == torch.float32
    assert tuple(q.scale.shape) == EMPTY_SCALE_SHAPES[shape][granularity]
    assert bool((q.scale == 1).all())
    assert q.expand_scale().shape == x.shape
    y = minifloat.fake_quantize(x, "e4m3", granularity, **kwargs)
    assert y.shape == x.shape and y.dtype == x.dtype


OVERFLOW_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", OVERFLOW_DTYPES)
@pytest.mark.parametrize("scale_format", ["pow2", "e8m0", "fp32"])
@pytest.mark.parametrize("fmt", formats.names())
@pytest.mark.parametrize("granularity", ["tensor", "row", (1, 4)])
def test_finite_input_near_dtype_max_stays_finite(dtype, scale_format, fmt, granularity):
    big = torch.finfo(dtype).max
    rows = [
        [big, -big, 1.0, -0.5],
        [big * 0.99, big * 0.75, 3.0, 0.0],
        [-big * 0.51, 1.0, 2.0, math.nan],
        [1.0, math.inf, -2.0, 0.0],
    ]
    x = torch.tensor(rows, dtype=dtype)
    y = minifloat.fake_quantize(x, fmt, granularity, scale_format=scale_format)
    d = quantize(x, fmt, granularity, scale_format=scale_format).dequantize(dtype)
    assert torch.equal(y.nan_to_num(0.0), d.nan_to_num(0.0))
    nan_group = torch.isnan(quantize(x, fmt, granularity, scale_format=scale_format).expand_scale())
    assert bool(torch.isnan(y[nan_group]).all())  # NaN/inf groups stay NaN ...
    assert bool(torch.isfinite(y[~nan_group]).all())  # ... and nothing finite becomes inf
    assert bool((y[~nan_group].float().abs() <= big).all())
    if granularity != "tensor":  # the first two rows are finite groups
        assert bool(torch.isfinite(y[:2]).all())


@pytest.mark.parametrize(
    ("dtype", "big", "scale_format"),
    [
        (torch.float16, 65504.0, "pow2"),
        (torch.float16, 65504.0, "e8m0"),
        (torch.bfloat16, torch.finfo(torch.bfloat16).max, "pow2"),
        (torch.float32, 3e38, "pow2"),
        (torch.float32, torch.finfo(torch.float32).max, "pow2"),
    ],
)
def test_rounding_past_dtype_max_saturates(dtype, big, scale_format):
    # E2M1 with a power-of-two scale rounds these up to 4 * 2^k, one past dtype's max.
    x = torch.tensor([[big, -big / 8]], dtype=dtype)
    q = quantize(x, "e2m1", "row", scale_format=scale_format)
    assert q.values[0, 0] == 4.0 and (q.values[0, 0].double() * q.scale.double()) > big
    assert bool(torch.isinf((q.values * q.expand_scale()).to(dtype)[0, 0]))  # unsaturated
    y = minifloat.fake_quantize(x, "e2m1", "row", scale_format=scale_format)
    assert y[0, 0].item() == torch.finfo(dtype).max and bool(torch.isfinite(y).all())
    assert q.dequantize(dtype)[0, 0].item() == torch.finfo(dtype).max


@pytest.mark.parametrize("fmt", formats.names())
def test_e8m0_scale_keeps_values_times_scale_finite(fmt):
    # pow2_ceil(amax / max) of a group near float32's max could be 2^(128 - emax), and a value
    # rounded up to the next power of two then decoded to 2^128 = inf (E2M1: 4 * 2^126). OCP MX's
    # shared exponent floor(log2 amax) - emax is at most 127 - emax: values saturate instead.
    f, big = formats.get(fmt), torch.finfo(torch.float32).max
    x = torch.tensor([[big, -big / 8], [3.0e38, 1.0], [2.0**127, -1.0]])
    q = quantize(x, fmt, "row", scale_format="e8m0")
    top = formats.e8m0_max(f.max)
    assert top == 2.0 ** min(127, 127 - math.floor(math.log2(f.max)))
    assert top * f.max <= big and (2 * top * f.max > big or top == 2.0**127)  # the largest
    assert bool((q.scale <= top).all()) and q.values[0, 0] == f.max
    assert bool(torch.isfinite(q.values * q.expand_scale()).all())


def test_dequantize_rejects_non_floating_dtype():
    q = quantize(torch.randn(4, 4), "int8", "row")
    with pytest.raises(TypeError, match="floating"):
        q.dequantize(torch.int32)


@pytest.mark.parametrize("scale_format", SCALE_FORMATS)
@pytest.mark.parametrize("fmt", formats.names())
def test_extreme_group_amax_keeps_results_finite(scale_format, fmt):
    # A subnormal amax once gave a zero scale (0 / 0 = NaN for the group's zeros); a huge amax
    # with E1M2's max < 2 once gave a pow2 scale of 2^128 = inf.
    x = torch.tensor([[1e-45, 0.0, -3e-45], [3.4e38, 0.0, -1e38], [2.0**-140, 0.0, 1e-42]])
    q = quantize(x, fmt, "row", scale_format=scale_format)
    assert bool(torch.isfinite(q.scale).all()) and bool((q.scale > 0).all())
    d = q.dequantize()
    assert bool(torch.isfinite(d).all())
    assert bool((d[:, 1] == 0).all())
    if scale_format in ("fp32", "pow2"):  # these keep subnormal groups representable
        assert d[0, 0] == x[0, 0] and d[0, 2] == x[0, 2]


@pytest.mark.parametrize("big", [1e300, -4e38])
def test_float64_values_beyond_float32_are_refused(big):
    with pytest.raises(ValueError, match="computes in float32"):
        quantize(torch.tensor([[big, 1.0]], dtype=torch.float64), "e4m3", "row")


def test_float64_infinities_still_make_their_group_nan():
    q = minifloat.fake_quantize(
        torch.tensor([[float("inf"), 1.0], [3e38, 1.0]], dtype=torch.float64), "e4m3", "row"
    )
    assert q[0].isnan().all() and q[1].isfinite().all()
