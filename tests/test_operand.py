"""kernels/operand.py: the GEMM operand quantizer, bit for bit `minifloat.quantize.quantize`.

Eager on the CPU (the emulation), compiled on the CPU (what inductor may rewrite: divisions,
reduction order, fusion), compiled on a GPU (`-m gpu`: the fast path), each against the
reference on random data and adversarial rows (exact grid midpoints, huge, tiny, subnormal,
zero, NaN and inf entries); plus E2M1 packing.
"""

from __future__ import annotations

import functools

import pytest
import torch

from bits import bits_equal
from minifloat import formats
from minifloat.kernels import operand
from minifloat.quantize import quantize

FMTS = ["e2m1", "e4m3", "e5m2"]
GRANULARITIES = ["tensor", "row", (1, 32), (1, 128), (32, 32), (16, 128)]
# Long enough columns (512 rows) and rows (384 columns) for both two-stage amax reductions.
TWO_STAGE = (512, 384)
CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def adversarial(r: int, c: int, fmt: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Heavy-tailed random rows plus rows built to land on rounding boundaries and specials."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(r, c, generator=gen) * torch.exp(3 * torch.randn(r, c, generator=gen))
    grid = formats.get(fmt).grid.float()
    points = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])  # grid points and exact midpoints
    s = x.abs().amax(1, keepdim=True) / grid[-1]
    n, row = min(points.numel(), c), torch.zeros(c)
    tops = torch.tensor([448.0, 464.0, 480.0, 57344.0, 61440.0])  # E4M3 / E5M2 tops
    specials = [
        torch.cat([points[:n] * s[0], x[0, n:]]),  # x / scale lands exactly on ties
        torch.cat([-points[:n] * s[1 % r], x[1 % r, n:]]),
        row,
        row.index_fill(0, torch.tensor([min(3, c - 1)]), float("nan")),
        row.index_fill(0, torch.tensor([min(4, c - 1)]), float("inf")),
        torch.full((c,), 1e-42),  # subnormal amax: the scale's floor
        torch.cat([tops, torch.ones(c)])[:c],
        row.index_fill(0, torch.tensor([0]), 3.0e38),  # huge, finite
    ]
    for i, special in enumerate(specials[:r]):
        x[i] = special
    return x.to(dtype)


def reference(x: torch.Tensor, fmt: str, granularity, transpose: bool, scale_format="fp32"):
    q = quantize((x.t() if transpose else x).float(), fmt, granularity, scale_format=scale_format)
    return q.values, q.scale.reshape(q.scale.shape if q.scale.dim() == 2 else (1, 1))


def check(fn, x, fmt, granularity, transpose, scale_format="fp32"):
    kw = {} if scale_format == "fp32" else {"scale_format": scale_format}
    values, scale = fn(x, fmt, granularity, transpose=transpose, **kw)
    want_values, want_scale = reference(x, fmt, granularity, transpose, scale_format)
    assert values.dtype == operand.FP8_STORAGE[fmt]
    assert bits_equal(values, want_values), "values differ from quantize()"
    assert bits_equal(scale, want_scale), "scales differ from quantize()"


@pytest.mark.parametrize("scale_format", ["fp32", "inv"])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("granularity", GRANULARITIES, ids=str)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_equals_reference(dtype, fmt, granularity, transpose, scale_format):
    x = adversarial(*TWO_STAGE, fmt, dtype)
    check(operand.quantize_operand, x, fmt, granularity, transpose, scale_format)


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pow2_scales_eager_equal_reference(dtype, fmt, granularity, transpose):
    x = adversarial(*TWO_STAGE, fmt, dtype)
    check(operand.quantize_operand, x, fmt, granularity, transpose, "pow2")


@pytest.mark.parametrize("fmt", FMTS)
def test_inv_scales_of_special_rows(fmt):
    # subnormal and tiny maxima (the multiplier's 2^126 cap), a zero row, inf and NaN, and a
    # row whose multiplier is a power of two, so that x * m lands exactly on grid midpoints
    fmax = formats.get(fmt).max
    grid = formats.get(fmt).grid.float()[:8]
    midpoints = (grid[1:] + grid[:-1]) / 2
    x = torch.full((7, 64), 1e-42)
    x[1], x[2, 0], x[3] = 3e-39, 1e-45, 0.0
    x[4, 5], x[5, 9] = float("inf"), float("nan")
    x[6] = 0.01
    x[6, :8], x[6, 8:15], x[6, 15] = grid / 8, -midpoints / 8, fmax / 8  # m = 8 exactly
    values, scale = operand.quantize_operand(x, fmt, "row", scale_format="inv")
    want = quantize(x, fmt, "row", scale_format="inv")
    assert bits_equal(values, want.values) and bits_equal(scale, want.scale)
    assert scale[3].item() == 1.0 and (scale[:3] == 2.0**-126).all()
    assert scale[4].isnan() and scale[5].isnan() and scale[6].item() == 1 / 8
    assert torch.equal(values[6, :8].float(), grid) and values[6, 15].item() == fmax
    # exact ties round to the even neighbour
    assert torch.equal(values[6, 8:15].float(), formats.get(fmt).round(-midpoints))


@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("transpose", [False, True])
def test_inv_multipliers_are_the_ones_the_values_were_rounded_with(granularity, transpose):
    # DGE evaluates f' at w * m (QOperand.multiplier): m of the operand's own groups, of its
    # scale's shape, the values' round(x * m); no multipliers for fp32 scales or for blocks
    x = adversarial(*TWO_STAGE, "e2m1", torch.float32)
    values, scale, m = operand.quantize_operand(
        x, "e2m1", granularity, transpose=transpose, scale_format="inv", with_multiplier=True
    )
    groups = x.t() if transpose else x
    amax = groups.abs().amax() if granularity == "tensor" else groups.abs().amax(1)
    want_m, want_scale = formats.inv_scales(amax.reshape(scale.shape), formats.get("e2m1").max)
    assert bits_equal(m, want_m) and bits_equal(scale, want_scale)
    rounded = formats.get("e2m1").round(groups * want_m)
    assert bits_equal(values.float(), rounded)
    for fmt_, g, sf in (("e2m1", "row", "fp32"), ("e4m3", (1, 32), "inv")):
        assert (
            operand.quantize_operand(x, fmt_, g, scale_format=sf, with_multiplier=True)[2] is None
        )


@pytest.mark.parametrize("fmt", FMTS)
def test_pow2_scales_of_tiny_rows_divide_exactly(fmt):
    # scales of 2^-149 .. 2^-127, whose reciprocals float32 cannot hold, and a zero row
    x = torch.full((5, 64), 1e-42)
    x[1], x[2, 0], x[3], x[4, 7] = 3e-39, 1e-45, 0.0, 2.0**-130
    values, scale = operand.quantize_operand(x, fmt, "row", scale_format="pow2")
    want = quantize(x, fmt, "row", scale_format="pow2")
    assert bits_equal(values, want.values) and bits_equal(scale, want.scale)
    assert scale[3].item() == 1.0 and (scale[:3] < 2.0**-126).all()


def test_pow2_scales_refuse_what_they_do_not_cover():
    x = torch.randn(32, 64)
    with pytest.raises(ValueError, match="tensor or row maxima"):
        operand.quantize_operand(x, "e4m3", (1, 32), scale_format="pow2")
    with pytest.raises(ValueError, match="tensor or row maxima"):
        operand.quantize_operand(x, "e4m3", "tensor", scale=torch.ones(1, 1), scale_format="pow2")
    with pytest.raises(ValueError, match="'fp32', 'pow2' or 'inv'"):
        operand.quantize_operand(x, "e4m3", "row", scale_format="e8m0")
    with pytest.raises(ValueError, match="not a given scale"):
        operand.quantize_operand(x, "e4m3", "tensor", scale=torch.ones(1, 1), scale_format="inv")


@pytest.mark.parametrize("shape", [(50, 384), (77, 130), (1, 17)])
def test_ragged_shapes(shape):
    x = adversarial(*shape, "e2m1", torch.float32)
    for granularity in ("row", (1, 128), (32, 32)):
        for transpose in (False, True):
            check(operand.quantize_operand, x, "e2m1", granularity, transpose)


def test_prescale_clip_and_given_scale():
    x = adversarial(128, 256, "e5m2", torch.bfloat16)
    col = torch.rand(1, 256) + 0.5
    row = torch.rand(128, 1) + 0.5
    lo, hi = torch.tensor(-2.0), torch.tensor(3.0)
    values, scale = operand.quantize_operand(x, "e5m2", "row", prescale=col)
    want = quantize(x.float() * col, "e5m2", "row")
    assert bits_equal(values, want.values) and bits_equal(scale, want.scale)
    values, scale = operand.quantize_operand(x, "e5m2", "row", prescale=row, transpose=True)
    want = quantize((x.float() * row).t(), "e5m2", "row")
    assert bits_equal(values, want.values) and bits_equal(scale, want.scale)
    values, _ = operand.quantize_operand(x, "e2m1", "row", clip=(lo, hi))
    clipped = torch.where(x.float().isfinite(), x.float().clamp(lo, hi), x.float())
    assert bits_equal(values, quantize(clipped, "e2m1", "row").values)
    given = torch.tensor([[0.37]])
    values, scale = operand.quantize_operand(x, "e4m3", "tensor", scale=given)
    assert torch.equal(scale, given)
    want = formats.get("e4m3").round(x.float() / given)  # saturating, but non-finite -> NaN
    want = torch.where(torch.isfinite(x.float() / given), want, float("nan"))
    assert bits_equal(values, want) and (~torch.isfinite(x)).any()
    with pytest.raises(ValueError, match="tensor granularity"):
        operand.quantize_operand(x, "e4m3", "row", scale=given)


@pytest.mark.slow
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("granularity", ["tensor", "row", (1, 128), (32, 32)], ids=str)
@pytest.mark.parametrize("fmt", FMTS)
def test_compiled_equals_reference_on_cpu(fmt, granularity, transpose):
    torch._dynamo.reset()
    fn = torch.compile(operand.quantize_operand, fullgraph=True)
    check(fn, adversarial(*TWO_STAGE, fmt, torch.bfloat16), fmt, granularity, transpose)


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize(
    ("scale_format", "granularity"),
    [("pow2", "tensor"), ("pow2", "row"), ("inv", "tensor"), ("inv", "row"), ("inv", (1, 128))],
    ids=str,
)
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
def test_own_scale_formats_compiled_equal_reference_on_cpu(
    fmt, scale_format, granularity, transpose
):
    torch._dynamo.reset()
    fn = torch.compile(operand.quantize_operand, fullgraph=True)
    x = adversarial(*TWO_STAGE, fmt, torch.bfloat16)
    check(fn, x, fmt, granularity, transpose, scale_format)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 tensor cores")
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("granularity", GRANULARITIES, ids=str)
@pytest.mark.parametrize("fmt", FMTS)
def test_compiled_on_gpu_equals_cpu_reference(fmt, granularity, transpose):
    torch._dynamo.reset()
    kw = dict(fmt=fmt, granularity=granularity, transpose=transpose)
    fn = torch.compile(functools.partial(operand.quantize_operand, **kw), fullgraph=True)
    x = adversarial(*TWO_STAGE, fmt, torch.bfloat16)
    values, scale = fn(x.cuda())
    want_values, want_scale = reference(x, fmt, granularity, transpose)
    assert bits_equal(values, want_values) and bits_equal(scale, want_scale)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 tensor cores")
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize(
    ("scale_format", "granularity"),
    [("pow2", "tensor"), ("pow2", "row"), ("inv", "tensor"), ("inv", "row"), ("inv", (1, 128)),
     ("inv", (128, 128))],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("fmt", FMTS)
def test_own_scale_formats_compiled_on_gpu_equal_cpu_reference(
    fmt, scale_format, granularity, transpose
):
    torch._dynamo.reset()
    kw = dict(fmt=fmt, granularity=granularity, transpose=transpose, scale_format=scale_format)
    fn = torch.compile(functools.partial(operand.quantize_operand, **kw), fullgraph=True)
    x = adversarial(*TWO_STAGE, fmt, torch.bfloat16)
    values, scale = fn(x.cuda())
    want_values, want_scale = reference(x, fmt, granularity, transpose, scale_format)
    assert bits_equal(values, want_values) and bits_equal(scale, want_scale)


def float32_sweep(stride: int) -> torch.Tensor:
    """Every `stride`-th float32 bit pattern from 0 to just past 6.0, every float32 within 4 ulps
    of an E2M1 grid point or midpoint, and specials; both signs."""
    top = int(torch.tensor(6.0).view(torch.int32)) + 8
    swept = torch.arange(0, top, stride, dtype=torch.int64).to(torch.int32)
    grid = formats.get("e2m1").grid.float()
    marks = torch.cat([grid, (grid[1:] + grid[:-1]) / 2]).view(torch.int32)
    near = (marks[:, None] + torch.arange(-4, 5, dtype=torch.int32)).flatten().clamp(min=0)
    specials = torch.tensor([float("inf"), float("nan"), 7.0, 3.0e38, 1e-45, 2.0**-126])
    v = torch.cat([swept, near]).view(torch.float32)
    return torch.cat([v, specials, -v, -specials])


@pytest.mark.parametrize("compiled", [False, True])
def test_e2m1_rounding_by_two_additions_equals_the_reference(compiled):
    """round_to_storage's E2M1 rounding ((|q| + C) - C, C = 2^23 x the spacing) against the
    reference's round(|q| / spacing) * spacing, ~10^6 float32 values of [0, 6] and past it
    (every float32 there, checked once: docs/hopper_sessions.md, session 52)."""
    q = float32_sweep(1009)
    fn = torch.compile(operand.round_to_storage) if compiled else operand.round_to_storage
    got = fn(q, "e2m1")
    torch._dynamo.reset()
    assert got.dtype == torch.float8_e4m3fn
    assert bits_equal(got.float(), formats.get("e2m1").round(q))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 (sm_89+)")
def test_e2m1_rounding_compiled_on_gpu_equals_the_reference():
    q = float32_sweep(1009)
    got = torch.compile(operand.round_to_storage)(q.cuda(), "e2m1")
    torch._dynamo.reset()
    assert bits_equal(got.float(), formats.get("e2m1").round(q))


def _saturation_inputs() -> torch.Tensor:
    """float32 values around and past every FP8 range (±0, the maxima and their neighbours,
    huge values, ±inf, NaN) and 2^16 random bit patterns."""
    g = torch.Generator().manual_seed(72)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), generator=g, dtype=torch.int32)
    edges = [0.0, 6.0, 448.0, 57344.0, 6.5, 464.0, 61440.0, 1e30, float("inf"), float("nan")]
    edges = torch.tensor(edges)
    near = edges[1:-2].view(torch.int32)[:, None] + torch.arange(-2, 3, dtype=torch.int32)
    v = torch.cat([edges, near.flatten().view(torch.float32)])
    return torch.cat([v, -v, bits.view(torch.float32)])


def _clamp_then_cast(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """The saturating cast as a clamp to ±max, then the cast (E2M1: its rounding)."""
    fmt_max = formats.get(fmt).max
    if fmt == "e2m1":
        return formats.get("e2m1").round(q)
    return q.clamp(-fmt_max, fmt_max).to(operand.FP8_STORAGE[fmt])


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2"])
def test_saturating_cast_is_the_clamp_then_the_cast(fmt, compiled):
    """round_to_storage's saturating cast: the bits of a clamp to ±max then the cast, NaN kept
    (as any NaN: a compiled CPU cast may flip its sign), -0.0 kept, ±inf to ±max, at the
    ranges' edges and over random bit patterns (a form of the clamp must keep these bits)."""
    q = _saturation_inputs()
    fn = torch.compile(operand.round_to_storage) if compiled else operand.round_to_storage
    got = fn(q, fmt)
    torch._dynamo.reset()
    assert bits_equal(got.float(), _clamp_then_cast(q, fmt).float())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 (sm_89+)")
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2"])
def test_saturating_cast_compiled_on_gpu_is_the_clamp_then_the_cast(fmt):
    q = _saturation_inputs()
    got = torch.compile(operand.round_to_storage)(q.cuda(), fmt)
    torch._dynamo.reset()
    assert bits_equal(got.float(), _clamp_then_cast(q, fmt).float())


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_abs_amax_through_magnitude_bits_equals_abs_then_amax(dtype, compiled):
    """The quantizers' maxima as integer maxima of the magnitude bits: the same values as
    |v|.amax for every dim, NaN exactly where a NaN is, inf where an inf is (and no NaN)."""
    gen = torch.Generator().manual_seed(2)
    v = torch.randn(64, 48, generator=gen) * torch.exp(8 * torch.randn(64, 48, generator=gen))
    v[0, 3], v[1, 5], v[2, :], v[3, :] = float("nan"), float("inf"), -0.0, 1e-42
    v[4, 7], v[4, 8], v[5, 1] = -float("inf"), float("nan"), -float("nan")
    v[:, 40] = -3.0e38
    v = v.to(dtype)
    fn = torch.compile(operand.abs_amax) if compiled else operand.abs_amax
    for dim in (None, 0, 1, (0, 1)):
        got = fn(v) if dim is None else fn(v, dim=dim, keepdim=True)
        want = v.abs().amax() if dim is None else v.abs().amax(dim=dim, keepdim=True)
        assert got.dtype == torch.float32
        assert bits_equal(got, want.float()), dim
    torch._dynamo.reset()
    assert bits_equal(operand.row_amax(v), v.abs().amax(1, keepdim=True).float())


def rows_just_over_max(fmt: str, rows: int = 32, cols: int = 64) -> torch.Tensor:
    """Rows whose "inv" quotient of the row maximum rounds above the format's max in float32
    (RN32(amax * m) > max: ~9 % of random maxima for E4M3 and E5M2, ~5 % for E2M1): the values
    `round_to_storage` casts
    without a clamp (saturate=False). Each row holds +amax and -amax."""
    fmax = formats.get(fmt).max
    gen = torch.Generator().manual_seed(1)
    amax = torch.rand(4096, 1, generator=gen) * torch.exp2(
        torch.randint(-100, 100, (4096, 1), generator=gen).float()
    )
    m, _ = formats.inv_scales(amax, fmax)
    over = amax[(amax * m) > fmax][:rows]
    assert over.numel() == rows
    x = (torch.rand(rows, cols, generator=gen) * 2 - 1) * over[:, None]
    x[:, 0], x[:, 1] = over, -over
    return x


@pytest.mark.parametrize("granularity", ["tensor", "row", (1, 64)], ids=str)
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("fmt", FMTS)
def test_inv_quotients_just_over_max_round_to_max_unclamped(fmt, compiled, granularity):
    """The "inv" quantizers cast without clamping to ±max (`round_to_storage`'s saturate=False):
    a row maximum whose float32 quotient is the float32 just above max still becomes ±max, as in
    the reference (which clamps), eagerly and compiled."""
    x = rows_just_over_max(fmt)
    fn = operand.quantize_operand
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    check(fn, x, fmt, granularity, False, "inv")
    if granularity != "tensor":  # each group's own maximum is one of these
        values, _ = fn(x, fmt, granularity, scale_format="inv")
        fmax = formats.get(fmt).max
        assert (values[:, 0].float() == fmax).all() and (values[:, 1].float() == -fmax).all()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 (sm_89+)")
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("fmt", FMTS)
def test_inv_quotients_just_over_max_on_gpu(fmt, compiled):
    """As the CPU test: ATen's CUDA casts (eager) and Triton's (compiled) take the float32 just
    above max to max, as the reference's clamp does."""
    x = rows_just_over_max(fmt)
    torch._dynamo.reset()
    fn = functools.partial(operand.quantize_operand, scale_format="inv")
    fn = torch.compile(fn, fullgraph=True) if compiled else fn
    values, scale = fn(x.cuda(), fmt, "row")
    want_values, want_scale = reference(x, fmt, "row", False, "inv")
    assert bits_equal(values, want_values) and bits_equal(scale, want_scale)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("fmt", FMTS)
def test_inv_remainder_keeps_its_clamp(fmt, compiled):
    """OCC's remainder rows take their maxima over finite entries only (`kernels/clip.py`), so
    a row holding inf or NaN may have remainder values far above its maximum: those casts
    keep the clamp to ±max even with "inv" scales (E2M1 values stay on the grid; E5M2 does
    not overflow to inf)."""
    x = torch.tensor([[float("inf"), 1000.0, 0.5, -0.1], [float("nan"), -1e5, 0.5, -0.1]])
    lo, hi = torch.tensor([[-1.0]]), torch.tensor([[1.0]])
    fn = operand.quantize_operand
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    values, _ = fn(x, fmt, "row", clip=(lo, hi), remainder=True, scale_format="inv")
    finite = values.float()[values.float().isfinite()]
    assert not values.float().isinf().any()
    assert (finite.abs() <= formats.get(fmt).max).all()


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("fmt", FMTS)
def test_inv_clamped_part_unclamped_equals_the_reference(fmt, compiled, granularity, transpose):
    """OCC's clamped part with "inv" scales is cast without the clamp to ±max: its maxima are
    those of the very values cast, so it equals `quantize` of the clamped x (which clamps).
    With OCC's [1, 1] bounds at ±o, o a maximum whose "inv" quotient rounds just above max in
    float32, every group's maximum is o: the case a missing bound would show (E2M1 off its
    grid, E5M2 overflowing; the CPU's E4M3 cast saturates by itself). Where the groups are x's
    rows, adversarial rows (ties, subnormal rows, NaN, inf) with per-row bounds follow."""
    fn = operand.quantize_operand
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    gen = torch.Generator().manual_seed(3)
    cases = []
    for o in rows_just_over_max(fmt, rows=4)[:, 0]:
        x = (torch.rand(48, 64, generator=gen) * 4 - 2) * o  # each row and column passes ±o
        cases.append((x, -o.reshape(1, 1), o.reshape(1, 1)))
    if granularity == "row" and not transpose:
        x = adversarial(16, 64, fmt, torch.float32)
        amax = x.abs().amax(1, keepdim=True)
        cases.append((x, -0.5 * amax.nan_to_num(), 0.75 * amax))
    for x, lo, hi in cases:
        values, scale = fn(
            x, fmt, granularity, clip=(lo, hi), transpose=transpose, scale_format="inv"
        )
        clamped = torch.where(x.isfinite(), torch.minimum(torch.maximum(x, lo), hi), x)
        want_values, want_scale = reference(clamped, fmt, granularity, transpose, "inv")
        assert bits_equal(values, want_values) and bits_equal(scale, want_scale)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_unclamped_cast_rounds_the_float_above_max_to_max(fmt):
    """The bound `saturate=False` relies on: the float32 just above max (and a few ulps more)
    casts to max in ATen, eagerly and compiled. (Far above it, ATen's casts differ by version
    and format: NaN, inf or max; the clamp makes it max.)"""
    fmax = formats.get(fmt).max
    near = (torch.tensor([fmax]).view(torch.int32) + torch.arange(0, 5, dtype=torch.int32)).view(
        torch.float32
    )
    for fn in (operand.round_to_storage, torch.compile(operand.round_to_storage)):
        got = fn(torch.cat([near, -near]), fmt, saturate=False).float()
        assert (got.abs() == fmax).all()
    torch._dynamo.reset()
    far = torch.tensor([fmax * 1.5])
    assert operand.round_to_storage(far, fmt).item() == fmax


@pytest.mark.parametrize("cols", [256, 255])
def test_pack_e2m1_round_trip(cols):
    values, _ = operand.quantize_operand(
        adversarial(64, cols, "e2m1", torch.float32), "e2m1", "row"
    )
    packed = operand.pack_e2m1(values)
    assert packed.dtype == torch.uint8 and packed.shape == (64, (cols + 1) // 2)
    back = operand.unpack_e2m1(packed, cols)
    finite = ~values.float().isnan()
    assert bits_equal(back.float()[finite], values.float()[finite])  # signed zeros included
    assert (back.float()[~finite] == 0).all()  # NaN has no code: its group's NaN scale keeps it
    # the packed codes are those of torch.float4_e2m1fn_x2 / minifloat.packing
    from minifloat.packing import pack_values

    ref = pack_values(values.float().nan_to_num(0.0), formats.get("e2m1")).view(torch.uint8)
    assert torch.equal(packed, ref)


def test_supports():
    assert operand.supports("e2m1", "row", "fp32", "nearest")
    assert operand.supports("e4m3", (1, 128), "fp32", "nearest")
    assert not operand.supports("e2m1", "row", "e8m0", "nearest")
    assert operand.supports("e4m3", "tensor", "pow2", "nearest")
    assert not operand.supports("e4m3", (1, 128), "pow2", "nearest")
    assert operand.supports("e4m3", (1, 128), "inv", "nearest")
    assert operand.supports("e2m1", "row", "inv", "nearest")
    assert not operand.supports("e2m1", "row", "fp32", "stochastic")
    assert not operand.supports("int8", "row", "fp32", "nearest")


@pytest.mark.parametrize(
    ("x", "fmt", "granularity", "error", "match"),
    [
        (torch.randn(8, 32), "int8", "row", ValueError, "formats are e2m1, e4m3, e5m2"),
        (torch.randn(8, 32), "e4m3", (0, 16), ValueError, "block .* of positive ints"),
        (torch.randn(8, 32), "e4m3", (1.0, 16.0), ValueError, "block .* of positive ints"),
        (torch.randn(8, 32), "e4m3", "rows", ValueError, "must be 'tensor', 'row' or a block"),
        (torch.randn(32), "e4m3", "row", ValueError, r"2-D \[R, C\] operand, got \(32,\)"),
        (torch.randn(2, 8, 32), "e4m3", "row", ValueError, "2-D"),
        (torch.ones(8, 32, dtype=torch.int32), "e4m3", "row", TypeError, "floating-point"),
    ],
    ids=["format", "zero-block", "float-block", "granularity", "1-D", "3-D", "int"],
)
def test_quantize_operand_refuses_bad_arguments_in_one_line(x, fmt, granularity, error, match):
    with pytest.raises(error, match=match):
        operand.quantize_operand(x, fmt, granularity)


def test_quantize_operand_refuses_a_scale_that_is_not_a_tensor():
    with pytest.raises(TypeError, match="a given scale must be a tensor, got float"):
        operand.quantize_operand(torch.randn(8, 32), "e4m3", "tensor", scale=0.1)
