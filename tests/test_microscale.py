"""kernels/microscale.py: the NVFP4 / MXFP4 operand quantizer is bit for bit
`minifloat.quantize.quantize` (eager and compiled, with stochastic rounding and Hadamard
transforms), E2M1 x E4M3/E8M0 products are exact in bf16 (the tensor scale is not), and the GEMM
equals a float64 reference of the same math."""

from __future__ import annotations

import pytest
import torch

from bits import bits_equal
from minifloat import counter_rng, formats, hadamard
from minifloat.kernels import EmulatedBackend, microscale
from minifloat.quantize import quantize
from minifloat.recipes import OperandSpec
from test_operand import adversarial

CPU = torch.device("cpu")
U = 2.0**-24
CASES = [("e4m3", (1, 16)), ("e4m3", (16, 16)), ("e8m0", (1, 32)), ("e4m3", (1, 32))]


def reference(x, block, scale_format, *, transpose, stochastic=False, hadamard_size=0, seed=0):
    """quantize() of the operand the quantizer sees: transposed, rotated, with the same draws."""
    seed_t = torch.tensor(seed)
    v = (x.t() if transpose else x).float()
    if hadamard_size:
        signs = counter_rng.random_signs(counter_rng.derive(seed_t, "signs"), hadamard_size, CPU)
        v = hadamard.rotate(v, signs, dim=1)
    noise = None
    if stochastic:
        noise = counter_rng.uniform(counter_rng.derive(seed_t, "noise"), tuple(v.shape), CPU)
    rounding = "stochastic" if stochastic else "nearest"
    return quantize(v, "e2m1", block, scale_format=scale_format, rounding=rounding, noise=noise)


def check(fn, x, block, scale_format, *, seed=0, **kw):
    values, b, ts = fn(x, block, scale_format, **kw, seed=torch.tensor(seed))
    want = reference(x, block, scale_format, **kw, seed=seed)
    assert values.dtype == torch.float8_e4m3fn and values.shape == want.values.shape
    assert bits_equal(values, want.values), "values differ from quantize()"
    assert b.dtype == (torch.float8_e4m3fn if scale_format == "e4m3" else torch.float32)
    combined = b.float() * ts  # the divisor quantize() used, where the block is not all zero
    nonzero = want.scale != 1
    assert bits_equal(combined[nonzero], want.scale[nonzero])
    assert torch.equal(combined.isnan(), want.scale.isnan())
    if scale_format == "e8m0":
        assert torch.equal(ts, torch.ones(1, 1))


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize(("scale_format", "block"), CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_equals_reference(dtype, scale_format, block, transpose):
    x = adversarial(128, 192, "e2m1", dtype)
    check(microscale.quantize_microscaled, x, block, scale_format, transpose=transpose)
    check(microscale.quantize_microscaled, x, block, scale_format, transpose=transpose,
          stochastic=True, hadamard_size=16, seed=5)  # fmt: skip


@pytest.mark.parametrize("shape", [(50, 72), (17, 33)])
def test_ragged_shapes(shape):
    x = adversarial(*shape, "e2m1", torch.float32)
    for scale_format, block in CASES:
        for transpose in (False, True):
            check(microscale.quantize_microscaled, x, block, scale_format, transpose=transpose,
                  stochastic=True, hadamard_size=16, seed=1)  # fmt: skip


def test_e8m0_scale_range_and_extremes():
    """pow2 ceilings by bit operations equal formats.pow2_ceil, subnormal and huge amax too."""
    raw = torch.tensor([2.0**-149, 2.0**-130, 2.0**-127, 1.1 * 2.0**-127, 2.0**-126, 0.3, 1.0,
                        3.0, 2.0**126 * 1.5, 2.0**127, 3.0e38])  # fmt: skip
    want = formats.pow2_ceil(raw).clamp(2.0**-127, 2.0**125)  # 6 * 2^125: E2M1's finite top
    assert bits_equal(microscale._pow2_ceil_e8m0(raw), want)
    x = torch.tensor([[1e-40, 3e-39, 0.0, 1.0] * 8, [3.0e38, -2.0, 1.0, 0.5] * 8])
    check(microscale.quantize_microscaled, x, (1, 32), "e8m0", transpose=False)


@pytest.mark.parametrize("stochastic", [False, True])
def test_e8m0_blocks_near_float32_max_stay_finite(stochastic):
    """A finite block past 6 * 2^125 once got the scale 2^126 and a value rounded up to 4:
    4 * 2^126 = inf in the GEMM operand, inf and NaN (inf * 0) in the output. The scale stays
    2^125 and the values saturate to +-6; NaN and inf blocks still come out NaN."""
    fmax = torch.finfo(torch.float32).max
    x = torch.ones(4, 64)
    x[0, 0], x[1, :2], x[2, 40] = 3.0e38, torch.tensor([fmax, -fmax]), float("inf")
    x[3, 33] = float("nan")
    spec = OperandSpec(fmt="e2m1", granularity=(1, 32), scale_format="e8m0",
                       rounding="stochastic" if stochastic else "nearest")  # fmt: skip
    q = _operand(x, spec, seed=torch.tensor(4))
    assert q.scale[0, 0] == q.scale[1, 0] == 2.0**125
    assert q.values()[0, 0] == 6.0 and q.values()[1, :2].tolist() == [6.0, -6.0]
    vb = microscale.exact_bf16_values(q)
    assert bool(vb[:2].isfinite().all()) and bool(vb[:2, :32].abs().max() == 6 * 2.0**125)
    assert bool(vb[2, 32:].isnan().all() and vb[3, 32:].isnan().all())
    out = EmulatedBackend().scaled_mm(
        q, _operand(torch.eye(64) * 2.0**-8, spec), out_dtype=torch.float32
    )
    assert bool(out[:2].isfinite().all()) and bool(out[2:].isnan().all())  # NaN propagates


@pytest.mark.parametrize(
    ("n", "tokens", "most"),
    [(64, 20, 32), (32, 3, 16), (64, 32, 32), (32, 20, None), (16, 3, None), (64, 33, None)],
)
@pytest.mark.parametrize("transpose", [False, True])
def test_hadamard_longer_than_the_tokens_need_is_refused(n, tokens, most, transpose):
    """A transform longer than both the block (16) and the tokens rounded up to a power of two
    only rotates zero padding into larger operands: refused before quantizing, naming the
    largest size that would do; the block's own size passes on any length."""
    spec = OperandSpec(fmt="e2m1", granularity=(1, 16), scale_format="e4m3", hadamard=n)
    x = torch.randn(tokens, 32) if transpose else torch.randn(32, tokens)  # contraction: tokens
    if most is not None:
        with pytest.raises(ValueError, match=rf"rht.size={n}: .* use rht.size <= {most}$"):
            _operand(x, spec, transpose=transpose)
    else:
        assert _operand(x, spec, transpose=transpose).shape == (32, -(-tokens // n) * n)


@pytest.mark.slow
def test_compiled_equals_eager():
    """With stochastic rounding, a Hadamard transform, a transposed operand and adversarial
    values: the pinned forms (div_rn, bit-level pow2 ceilings, integer hashes, add/sub
    butterflies) give the same bits compiled. (nvfp4 and mxfp4 layers are compiled whole in
    tests/test_compile.py.)"""
    torch._dynamo.reset()
    fn = torch.compile(microscale.quantize_microscaled, fullgraph=True)
    x = adversarial(64, 96, "e2m1", torch.bfloat16)
    kw = dict(transpose=True, stochastic=True, hadamard_size=16, seed=torch.tensor(9))
    got = fn(x, (1, 32), "e8m0", **kw)
    for a, b in zip(got, microscale.quantize_microscaled(x, (1, 32), "e8m0", **kw), strict=True):
        assert bits_equal(a, b)


def test_e2m1_times_block_scales_is_exact_in_bf16():
    e2m1 = formats.get("e2m1").grid.double()
    e2m1 = torch.cat([e2m1, -e2m1])
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    e4m3 = e4m3[e4m3.isfinite()]
    e8m0 = torch.tensor([2.0**k for k in range(-127, 126)], dtype=torch.float64)  # 2^125 tops
    for scales in (e4m3, e8m0):
        prod = (e2m1[:, None] * scales[None, :]).flatten()  # exact in float64
        assert torch.equal(prod.to(torch.bfloat16).double(), prod)  # finite too
    # ... but not times an fp32 tensor scale (amax / 2688): that one stays outside the GEMM
    ts = torch.tensor(3.7 / 2688, dtype=torch.float32).double()
    prod = (e2m1[:, None] * e4m3[None, :] * ts).flatten()
    assert not torch.equal(prod.to(torch.bfloat16).double(), prod)


def _operand(x, spec, **kw):
    return EmulatedBackend().quantize(x, spec, **kw)


@pytest.mark.parametrize(("scale_format", "block"), CASES[:1] + CASES[2:3], ids=str)
def test_gemm_matches_float64_reference(scale_format, block):
    gen = torch.Generator().manual_seed(0)
    a_hp = torch.randn(48, 128, generator=gen) * torch.exp(torch.randn(48, 1, generator=gen))
    b_hp = torch.randn(64, 128, generator=gen)
    spec = OperandSpec(fmt="e2m1", granularity=block, scale_format=scale_format)
    a, b = _operand(a_hp, spec), _operand(b_hp, spec)
    out = EmulatedBackend().scaled_mm(a, b, out_dtype=torch.float32)

    def exact(q):  # values x block scale x tensor scale, in float64, tensor scale kept apart
        vb = microscale.exact_bf16_values(q).double()
        assert torch.equal(vb.to(torch.bfloat16).double(), vb)
        return vb, 1.0 if q.tensor_scale is None else q.tensor_scale.double()

    (av, at), (bv, bt) = exact(a), exact(b)
    want = (av @ bv.t()) * at * bt
    bound = (128 + 4) * U * (av.abs() @ bv.abs().t()) * at * bt
    assert ((out.double() - want).abs() <= bound + 1e-30).all()
