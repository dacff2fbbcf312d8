"""OCC's clamp and remainder row maxima from the operand's row extrema (kernels/clip.py)."""

from __future__ import annotations

import pytest
import torch

from bits import bits_equal
from minifloat.kernels import EmulatedBackend
from minifloat.kernels.clip import (
    clamp,
    clamped_row_amax,
    one_stage,
    remainder,
    remainder_row_amax,
    row_reduce,
)
from minifloat.kernels.operand import quantize_operand
from minifloat.recipe_specs import OperandSpec

_NAN, _INF = float("nan"), float("inf")


def _rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Heavy-tailed rows, one of them all equal, with NaN and ±inf planted in others."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    x[0] = 0.75  # a constant row
    x[1, 3] = _NAN
    x[2, 5] = _INF
    x[3, 7] = -_INF
    x[4] = _INF  # no finite entry
    x[5, :2] = torch.tensor([_INF, -_INF])
    x[6] = -0.0
    return x.to(dtype)


def _finite_rows(x: torch.Tensor) -> torch.Tensor:
    return x.float().isfinite().all(dim=1)


def _bounds(kind: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    finite = x.float()[x.float().isfinite()]
    lo, hi = torch.quantile(finite, 0.02), torch.quantile(finite, 0.98)
    if kind == "equal":
        hi = lo.clone()
    elif kind == "nan":
        lo = hi = torch.tensor(_NAN)
    elif kind == "inside":  # bounds that clip nothing
        lo, hi = finite.min() - 1, finite.max() + 1
    return lo.float(), hi.float()


@pytest.mark.parametrize("kind", ["quantiles", "equal", "nan", "inside"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16, 96), (12, 1024)])  # one-stage and two-stage rows
def test_row_amax_from_extrema_equals_a_pass(kind, dtype, shape):
    x = _rows(*shape, dtype, seed=shape[1])
    lo, hi = _bounds(kind, x)
    want_c = row_reduce(clamp(x, lo, hi).abs(), torch.amax)
    want_d = row_reduce(remainder(x, lo, hi).abs(), torch.amax)
    got_c, got_d = clamped_row_amax(x, lo, hi), remainder_row_amax(x, lo, hi)
    assert got_c.dtype == got_d.dtype == torch.float32 and got_c.shape == (shape[0], 1)
    if kind == "nan":  # no finite bound: both NaN or inf in every row, so every output is NaN
        assert not got_c.isfinite().any() and not want_c.isfinite().any()
        assert got_d.isnan().all() and want_d.isnan().all()
        return
    torch.testing.assert_close(got_c, want_c, rtol=0, atol=0, equal_nan=True)
    # Δx's row maxima are exact in rows of finite entries; in the others x_c's is NaN or inf,
    # so every output of the row is NaN whatever Δx's is (kernels/clip.py)
    rows = _finite_rows(x)
    torch.testing.assert_close(got_d[rows], want_d[rows], rtol=0, atol=0)
    assert not got_c[~rows].isfinite().any() and got_d[~rows].isfinite().all()
    if kind == "quantiles":  # the planted rows: NaN, inf, and no finite entry
        assert got_c[1].isnan() and got_c[2].isinf() and got_c[3].isinf()
        assert got_d[4] == 0 and got_d[1].isfinite()


@pytest.mark.parametrize("reduce", [torch.amax, torch.amin])
def test_row_reduce_two_stages_equal_one(reduce):
    x = torch.randn(8, 2048)
    two = row_reduce(x, reduce)
    torch.testing.assert_close(two, reduce(x, dim=1, keepdim=True), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("dim", "width", "single"),
    [(2048, 256, False), (11008, 256, False), (11008, 512, True), (768, 512, True),
     (256, 256, True), (128, 256, True)],
)  # fmt: skip
def test_one_stage_where_partials_would_not_tile_the_dim_or_would_be_one(dim, width, single):
    assert one_stage(dim, width) is single
    x = torch.randn(2, dim)
    # either way the reduction is the one-stage one's, bit for bit
    assert torch.equal(row_reduce(x, torch.amax, width), x.amax(dim=1, keepdim=True))


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
@pytest.mark.parametrize("part", ["clamped", "remainder"])
def test_quantize_operand_of_clip_parts_equals_quantizing_the_part(fmt, part):
    """Row scales from x's extrema quantize exactly as a pass over the clamped x or Δx does."""
    x = _rows(16, 512, torch.float32, seed=3)
    x[1, 3] = 1.0  # NaN rows quantize to NaN either way; keep the comparison about the scales
    lo, hi = _bounds("quantiles", x)
    remainder_part = part == "remainder"
    got = quantize_operand(x, fmt, "row", clip=(lo, hi), remainder=remainder_part)
    materialized = (remainder if remainder_part else clamp)(x, lo, hi)
    want = quantize_operand(materialized, fmt, "row")
    rows = _finite_rows(x)  # in the others x_c's scale is NaN: every output there is NaN
    assert (~rows).sum() == 4
    for g, w in zip(got, want, strict=True):
        g, w = g.float().nan_to_num(), w.float().nan_to_num()
        assert torch.equal(g[rows], w[rows]) and (part == "remainder" or torch.equal(g, w))


def test_remainder_needs_clip():
    with pytest.raises(ValueError, match="clip"):
        quantize_operand(torch.ones(2, 4), "e4m3", "row", remainder=True)


@pytest.mark.parametrize(
    "spec",
    [
        OperandSpec(fmt="e4m3", granularity="row"),  # operand.quantize_operand
        OperandSpec(fmt="e4m3", granularity="tensor"),
        OperandSpec(fmt="e2m1", granularity=(1, 16), scale_format="e4m3"),  # microscale
        OperandSpec(fmt="e4m3", granularity="row", rounding="stochastic"),  # the reference
    ],
    ids=["row", "tensor", "nvfp4-block", "reference"],
)
def test_backend_quantizes_the_remainder_as_the_remainder_itself(spec):
    x = _rows(16, 256, torch.float32, seed=5)
    x[1, 3] = 1.0
    clip = _bounds("quantiles", x)
    torch.manual_seed(0)  # the same draws for stochastic rounding
    got = EmulatedBackend().quantize(x, spec, clip=clip, remainder=True)
    torch.manual_seed(0)
    want = EmulatedBackend().quantize(remainder(x, *clip), spec)
    # Row scales from x's extrema (operand.quantize_operand's): exact in the rows of finite
    # entries (kernels/clip.py). Every other spec quantizes the remainder itself.
    from_extrema = spec.granularity == "row" and spec.rounding == "nearest"
    rows = _finite_rows(x) if from_extrema else slice(None)
    for g, w in ((got.data, want.data), (got.scale, want.scale)):
        assert torch.equal(g.float().nan_to_num()[rows], w.float().nan_to_num()[rows])


# OCC's bounds are a sorted sample's quantiles: lo <= hi, and NaN sorts last (lo NaN: hi too)
_BOUNDS = [(-1.0, 1.0), (0.0, 1.0), (-1.0, -0.0), (-0.0, 0.0), (0.0, 0.0), (2.5, 2.5),
           (-3e38, 3e38), (_NAN, _NAN), (-1.0, _NAN)]  # fmt: skip


def _bit_patterns() -> torch.Tensor:
    """2^18 random float32 bit patterns (NaN payloads and subnormals among them) and ±0, ±1,
    ±inf, NaN: a [1, N] row."""
    gen = torch.Generator().manual_seed(7)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), generator=gen, dtype=torch.int32)
    specials = torch.tensor([0.0, -0.0, 1.0, -1.0, _INF, -_INF, _NAN])
    return torch.cat([bits.view(torch.float32), specials]).reshape(1, -1)


@pytest.mark.parametrize(("lo", "hi"), _BOUNDS, ids=str)
def test_clamp_and_remainder_equal_torch_clamp_of_finite_entries(lo, hi):
    """OCC's clamp is torch.clamp on finite entries (NaN bounds included) and passes the rest
    through; the remainder is x minus it there, 0 elsewhere: eager ATen's values, bit for bit.
    The definition the compare-select form (session 58) keeps."""
    x = _bit_patterns()
    lo_t, hi_t = torch.tensor([[lo]]), torch.tensor([[hi]])
    fin = x.isfinite()
    want = torch.where(fin, torch.clamp(x, lo_t, hi_t), x)
    assert bits_equal(clamp(x, lo_t, hi_t), want)
    want_rem = torch.where(fin, x - torch.clamp(x, lo_t, hi_t), lo_t - lo_t)
    assert bits_equal(remainder(x, lo_t, hi_t), want_rem)


@pytest.mark.parametrize(("lo", "hi"), _BOUNDS, ids=str)
def test_clamp_and_remainder_compiled_equal_eager(lo, hi):
    """Signed zeros included: with torch.clamp, a bound of exactly ±0 made them differ
    (compiled, max(-0.0, +0.0) is +0.0; eager keeps -0.0), until session 58."""
    x = _bit_patterns()
    lo_t, hi_t = torch.tensor([[lo]]), torch.tensor([[hi]])
    for fn in (clamp, remainder):
        torch._dynamo.reset()
        assert bits_equal(torch.compile(fn)(x, lo_t, hi_t), fn(x, lo_t, hi_t)), fn.__name__


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
    reason="needs a CUDA GPU with FP8 (sm_89+)",
)
@pytest.mark.parametrize(("lo", "hi"), _BOUNDS, ids=str)
def test_clamp_and_remainder_compiled_on_gpu_equal_cpu_eager(lo, hi):
    """Triton's code of the compare-selects (subnormal differences included) against the CPU."""
    x = _bit_patterns()
    lo_t, hi_t = torch.tensor([[lo]]), torch.tensor([[hi]])
    for fn in (clamp, remainder):
        torch._dynamo.reset()
        got = torch.compile(fn)(x.cuda(), lo_t.cuda(), hi_t.cuda()).cpu()
        assert bits_equal(got, fn(x, lo_t, hi_t)), fn.__name__
