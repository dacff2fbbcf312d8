"""Outlier Clamping and Compensation: thresholds, clipped fraction, fidelity, the layer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bits import bits_equal, same_e4m3
from minifloat import occ_gemm, recipes
from minifloat.exact import div_rn_by_scale
from minifloat.formats import inv_scales
from minifloat.kernels import EmulatedBackend
from minifloat.kernels.operand import round_to_storage
from minifloat.linear import QuantLinear
from minifloat.occ import (
    clamp,
    clipped_fraction,
    fold_remainder,
    joint_lhs,
    occ_activation,
    remainder,
    sample_stride,
    steps_passed,
    thresholds,
)
from minifloat.quantize import quantize, tensor_quantiles
from minifloat.recipes import OCCConfig
from minifloat.sqnr import sqnr_db, synthetic_activation, synthetic_weight
from tolerances import (
    OCC_DW_OVER_NONE_DB,
    OCC_DW_VS_FP32_DB,
    OCC_ONE_GEMM_VS_SEPARATE_DB,
    OCC_Y_VS_FP32_DB,
)


def heavy_tailed(m: int, k: int, seed: int, n_outlier_channels: int = 2) -> torch.Tensor:
    """Student-t (df=5) activations plus a few channels of consistently large magnitude (~12σ),
    like the 'massive activation' channels of LLMs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.distributions.StudentT(5.0).sample((m, k))
    cols = torch.randperm(k, generator=gen)[:n_outlier_channels]
    sign = torch.where(torch.rand(m, n_outlier_channels, generator=gen) < 0.5, -1.0, 1.0)
    magnitude = 12.0 * (1 + 0.2 * torch.randn(m, n_outlier_channels, generator=gen)).abs()
    x[:, cols] = sign * magnitude
    return x


@pytest.mark.parametrize("alpha", [0.999, 0.99, 0.97])
def test_clipped_fraction_is_two_tails(alpha):
    torch.manual_seed(1)
    x = heavy_tailed(128, 1024, seed=1)
    frac = clipped_fraction(x, OCCConfig(alpha=alpha, threshold="exact"))
    # exact quantiles of x: 2 (1 - alpha) to within a few of 131k entries (measured 1.4e-5)
    assert frac == pytest.approx(2 * (1 - alpha), rel=0.05)


def test_snr_ordering_as_in_paper_table_1():
    """no clamp < clamp 0.999 w/o compensation < with compensation 0.999 < 0.99 < 0.97."""
    torch.manual_seed(0)
    x = heavy_tailed(128, 2048, seed=0)
    settings = [
        None,
        OCCConfig(alpha=0.999, compensate=False),
        OCCConfig(alpha=0.999),
        OCCConfig(alpha=0.99),
        OCCConfig(alpha=0.97),
    ]
    snrs = [sqnr_db(x, occ_activation(x, "e2m1", "row", cfg)) for cfg in settings]
    for lower, higher in zip(snrs[:-1], snrs[1:], strict=True):
        assert higher > lower + 0.5, snrs  # each step measured >= 1.5 dB


def test_sample_stride_is_a_prime_that_visits_every_column():
    assert sample_stride(65536, 256, 65536) == 1  # small tensors: every entry
    for numel, row_len, n in ((16384 * 2048, 2048, 65536), (4096 * 11008, 11008, 65536),
                              (1024 * 1024, 1024, 65536), (50 * 17 * 4, 17 * 4, 1024)):  # fmt: skip
        s = sample_stride(numel, row_len, n)
        assert s >= 2 and all(s % d for d in range(2, s)), s  # prime
        assert row_len % s != 0  # so i*s mod row_len runs through every column
        assert -(-numel // s) <= n  # at most sample_size entries
    assert sample_stride(50 * 68, 68, 1024) == 5  # 4 would do, is not prime; 5 does not divide 68
    assert sample_stride(1000 * 1000, 1000, 65536) == 17  # 16 -> 17 (prime, 1000 % 17 != 0)


@pytest.mark.parametrize("threshold", ["sampled", "exact"])
def test_thresholds_share_one_buffer(threshold):
    """lo and hi are two entries of one tensor (so a compiled clamp reads one buffer for both,
    occ.thresholds), with the values `tensor_quantiles` gives for the same entries."""
    x = heavy_tailed(256, 512, seed=3, n_outlier_channels=4)
    cfg = OCCConfig(threshold=threshold, sample_size=4096)
    lo, hi = thresholds(x, cfg)
    assert lo.untyped_storage().data_ptr() == hi.untyped_storage().data_ptr()
    flat = x.reshape(-1)
    if threshold == "sampled":
        flat = flat[:: sample_stride(flat.numel(), x.shape[-1], cfg.sample_size)]
    want = tensor_quantiles(flat, cfg.alpha)
    assert torch.equal(lo, want[0]) and torch.equal(hi, want[1]) and lo < hi


def test_sampled_threshold_error():
    """The strided sample's quantiles against the exact ones on heavy-tailed activations:
    65536 entries leave a rank error of ~0.04 % (binomial sd); measured: each tail within
    0.05 % of 1 %, the thresholds within 1.5 % of the exact quantiles."""
    torch.manual_seed(2)
    x = heavy_tailed(1024, 1024, seed=2, n_outlier_channels=8)
    cfg = OCCConfig(alpha=0.99)
    assert cfg.threshold == "sampled" and x.numel() > 4 * cfg.sample_size
    lo, hi = thresholds(x, cfg)
    for tail in ((x < lo).float().mean().item(), (x > hi).float().mean().item()):
        assert abs(tail - 0.01) <= 0.002  # 5 sd
    exact = thresholds(x, dataclasses.replace(cfg, threshold="exact"))
    assert not torch.equal(torch.stack(exact), torch.stack((lo, hi)))  # really a sample
    for got, want in zip((lo, hi), exact, strict=True):
        assert abs(got / want - 1) <= 0.03
    # deterministic: the same sample every call
    assert torch.equal(torch.stack(thresholds(x, cfg)), torch.stack((lo, hi)))


def test_small_tensor_sampled_is_exact():
    x = torch.randn(64, 64)
    cfg = OCCConfig()
    exact = dataclasses.replace(cfg, threshold="exact")
    assert torch.equal(torch.stack(thresholds(x, cfg)), torch.stack(thresholds(x, exact)))


def test_remainder_and_clamp():
    x = torch.zeros(4, 6)
    x[1, 2], x[3, 5], x[0, 0], x[2, 1] = 10.0, -7.0, float("inf"), float("nan")
    lo, hi = torch.tensor(-1.0), torch.tensor(1.0)
    delta = remainder(x, lo, hi)
    want = torch.zeros(4, 6)
    want[1, 2], want[3, 5] = 9.0, -6.0  # non-finite entries are not clipped: they pass through
    assert torch.equal(delta, want)
    clamped = clamp(x, lo, hi)
    assert clamped[0, 0] == float("inf") and clamped[1, 2] == 1.0 and clamped[2, 1].isnan()


def test_fold_remainder():
    torch.manual_seed(5)
    x = heavy_tailed(64, 256, seed=5)
    lo, hi = thresholds(x, OCCConfig(threshold="exact"))
    xq = quantize(clamp(x, lo, hi), "e2m1", "row")
    values, t = fold_remainder(x, lo, hi, xq.values, xq.scale, None, 6.0)
    assert values.dtype == torch.float8_e4m3fn and values.shape == x.shape
    delta = remainder(x, lo, hi)
    z = xq.values + delta / xq.scale
    # t: the least power of two >= 1 with B / t <= 448, B = max_rows 6 + max|Δx| / s_x >= |z|
    # (z reaches ~12 sigma / 3 sigma * 6)
    bound = (6.0 + delta.abs().amax(dim=1, keepdim=True) / xq.scale).max().item()
    tv = t.item()
    assert tv >= 1 and tv == 2.0 ** round(torch.log2(t).item())
    assert bound / tv <= 448 and (tv == 1 or bound / (tv / 2) > 448)
    assert z.abs().max() <= bound
    unclipped = delta == 0
    folded = values.float() * t
    assert torch.equal(folded[unclipped], xq.values[unclipped])  # E2M1 values stay exact
    # clipped entries: z rounded to E4M3 (3 mantissa bits, relative error <= 2^-4)
    err = (folded - z).abs()[~unclipped]
    assert bool((err <= 2.0**-4 * z.abs()[~unclipped]).all()) and (~unclipped).any()
    # a large remainder needs t > 1
    big = x.clone()
    big[0, 0] = 1e6
    _, t_big = fold_remainder(big, lo, hi, xq.values, xq.scale, None, 6.0)
    assert t_big.item() > 1


@pytest.mark.parametrize("exponent", [0, 1, 7, 40, 63, 64])
def test_fold_by_the_inverse_power_of_two_is_the_quotient(exponent):
    """z · (1 / t), fold_remainder's form, gives the E4M3 bytes of the correctly rounded z / t
    for every float32 z (random bits: normals, subnormals, zeros, infinities, NaNs) at t from
    2^0 to 2^64, eagerly and compiled."""
    g = torch.Generator().manual_seed(exponent)
    z = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), generator=g, dtype=torch.int32)
    z = torch.cat([z.view(torch.float32), torch.tensor([0.0, -0.0, 1e-45, -448.0 * 2.0**exponent])])
    t = torch.tensor([[2.0**exponent]])
    want = round_to_storage(div_rn_by_scale(z.reshape(1, -1), t), "e4m3").view(torch.uint8)

    def fold(z: torch.Tensor, t_inv: torch.Tensor) -> torch.Tensor:
        return round_to_storage(z.reshape(1, -1) * t_inv, "e4m3").view(torch.uint8)

    t_inv = torch.tensor([[0.5**exponent]])
    assert torch.equal(fold(z, t_inv), want)
    # compiled on the CPU, a NaN's E4M3 byte may take another sign than eager's (its cast does
    # so without the product too): NaNs compare as NaNs
    got = torch.compile(fold)(z, t_inv)
    nan = (want & 0x7F) == 0x7F
    assert torch.equal((got & 0x7F) == 0x7F, nan) and torch.equal(got[~nan], want[~nan])


@pytest.mark.parametrize(
    "least, count", [(0, 64), (-6, 14), (-5, 11), (-5, 12), (-134, 3), (100, 20)]
)
def test_steps_passed_counts_the_comparisons(least, count):
    """steps_passed, from the bits, equals the count of steps 448·2^j (j = least .. least +
    count - 1) a value passes, the comparisons' own form, for random float32 bits (normals,
    subnormals, zeros, negatives, infinities, NaNs of either sign) and at every step and its
    neighbours, eagerly and compiled."""
    g = torch.Generator().manual_seed(count)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), generator=g, dtype=torch.int32)
    steps = 448.0 * 2.0 ** torch.arange(least, least + count, dtype=torch.float64)
    steps = steps.float()
    edges = torch.cat([steps, steps.nextafter(torch.tensor(0.0)), steps.nextafter(steps * 2)])
    special = torch.tensor([0.0, -0.0, 1e-45, 6.0, -1e30, 3e38, float("inf"), float("-inf")])
    nan_bits = torch.tensor([float("nan")]).view(torch.int32)
    nan = nan_bits | torch.tensor([0, -(2**31)], dtype=torch.int32)  # +NaN, -NaN
    v = torch.cat([bits.view(torch.float32), edges, special, nan.view(torch.float32)])
    want = (v[:, None] > steps).sum(dim=1, dtype=torch.int32)
    assert torch.equal(steps_passed(v, least, count), want)
    assert torch.equal(torch.compile(steps_passed)(v, least, count), want)
    assert want.min() == 0 and want.max() == count
    for bad in ((-135, 1), (100, 21)):
        with pytest.raises(ValueError, match="-134 <= least"):
            steps_passed(v, *bad)


def _fold_against_the_quotient(device: str, by_multiplier: bool) -> None:
    """fold_remainder on `device`, eagerly and compiled, against its definition computed on the
    CPU, Q_E4M3(z / t) with z / t correctly rounded: byte for byte, with t > 1 (a large
    remainder: 2^7 here). z = x_q + Δx·m_x, one float32 product, for an "inv" x_q given its
    multiplier m_x; z = x_q + Δx / s_x, correctly rounded, without one."""
    x = heavy_tailed(64, 256, seed=7)
    x[3, 5] = 3e4
    lo, hi = thresholds(x, OCCConfig(threshold="exact"))
    xq = quantize(clamp(x, lo, hi), "e2m1", "row", scale_format="inv" if by_multiplier else "fp32")
    delta = remainder(x, lo, hi)
    m_x = None
    if by_multiplier:
        m_x, s_x = inv_scales(clamp(x, lo, hi).abs().amax(1, keepdim=True), 6.0)
        assert torch.equal(s_x, xq.scale)  # m_x: x_q's own multiplier
        z = xq.values.float() + delta * m_x
    else:
        z = xq.values.float() + div_rn_by_scale(delta, xq.scale.float())
    args = [v.to(device) for v in (x, lo, hi, xq.values, xq.scale)]
    m_arg = None if m_x is None else m_x.to(device)
    for fold in (fold_remainder, torch.compile(fold_remainder)):
        values, t = fold(*args, m_arg, 6.0)
        want = round_to_storage(div_rn_by_scale(z, t.cpu()), "e4m3")
        assert t.item() == 2.0**7
        assert torch.equal(values.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("by_multiplier", [True, False])
def test_fold_remainder_is_the_quotient_by_t(by_multiplier):
    _fold_against_the_quotient("cpu", by_multiplier)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("by_multiplier", [True, False])
def test_fold_remainder_is_the_quotient_by_t_on_the_gpu(by_multiplier):
    """The same on CUDA, whose float32 products may flush subnormal results to zero."""
    _fold_against_the_quotient("cuda", by_multiplier)


def _inputs_a_contraction_would_change(rows: int = 16, cols: int = 64) -> tuple:
    """(x, lo, hi, x_values, s_x, m_x) for fold_remainder where z = x_q + Δx·m_x, its product
    and sum each rounded to float32, has another E4M3 byte in every clipped entry than the
    same sum rounded once (a fused multiply-add, as a compiler contracting the two would make
    it). x_q = -6 and Δx·m_x near 6 + an E4M3 midpoint, its float32 rounding exactly on it:
    twice rounded, z is the tie (to the even neighbour); once, just off it, on the odd
    neighbour's side. Bounds lo = -100, hi = -7, so Δx = x + 7; a quarter of the entries
    unclipped."""
    g = torch.Generator().manual_seed(76)
    # E4M3's midpoints in [2^-4, 2^-2) (spacing 2^-7, then 2^-6), in float64
    odd = 2 * torch.arange(8, dtype=torch.float64) + 1
    mids = torch.cat([2.0**-4 + odd * 2.0**-8, 2.0**-3 + odd * 2.0**-7])
    m_x = torch.empty(rows, 1)
    x = torch.full((rows, cols), -50.0)  # unclipped: inside [lo, hi]
    for r in range(rows):
        hits = torch.empty(0)
        while hits.numel() == 0:  # a multiplier with entries that show the contraction
            m = (1.0 + torch.rand((), generator=g)).float()
            base = ((6.0 + mids) / m.double()).float()  # Δx near (6 + mid) / m, and neighbours
            d = torch.cat([base, base.nextafter(base * 2), base.nextafter(base / 2)])
            exact = d.double() * m.double()  # Δx·m_x exactly (24 x 24 bits)
            twice = (exact.float() - 6.0).to(torch.float8_e4m3fn).view(torch.uint8)  # the tie
            once = (exact - 6.0).float().to(torch.float8_e4m3fn).view(torch.uint8)
            hits = d[twice != once]
        m_x[r] = m
        x[r, : cols * 3 // 4] = hits.repeat(cols)[: cols * 3 // 4] - 7.0  # exact: finer ulp
    x_values = torch.full((rows, cols), -6.0).to(torch.float8_e4m3fn)
    return x, torch.tensor(-100.0), torch.tensor(-7.0), x_values, 1.0 / m_x, m_x


def _fold_keeps_two_roundings(device: str) -> None:
    """fold_remainder by the multiplier, eagerly and compiled on `device`, gives the bytes of its
    product and sum each rounded (the eager CPU definition) on inputs where one rounding
    gives other bytes in every clipped entry: nothing contracts them into an FMA. On the CPU
    inductor's C++ is compiled with FMA contraction allowed here (off by default), so that the
    check means something there too: the plain product then sum did contract under it, in
    every clipped entry (and in Triton on an H200: docs/hopper_sessions.md, session 76)."""
    x, lo, hi, x_values, s_x, m_x = _inputs_a_contraction_would_change()
    delta = remainder(x, lo, hi)
    clipped = delta != 0
    twice = round_to_storage(x_values.float() + delta * m_x, "e4m3").view(torch.uint8)
    fused = (x_values.double() + delta.double() * m_x.double()).float()
    once = round_to_storage(fused, "e4m3").view(torch.uint8)
    assert clipped.float().mean() == 0.75 and bool((twice != once)[clipped].all())
    args = [v.to(device) for v in (x, lo, hi, x_values, s_x, m_x)]
    contract = {"cpp.enable_floating_point_contract_flag": "fast"} if device == "cpu" else {}
    with torch._inductor.config.patch(contract):
        for fold in (fold_remainder, torch.compile(fold_remainder)):
            values, t = fold(*args, 6.0)
            assert t.item() == 1.0
            assert torch.equal(values.cpu().view(torch.uint8), twice)


def test_fold_by_the_multiplier_keeps_its_two_roundings():
    _fold_keeps_two_roundings("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fold_by_the_multiplier_keeps_its_two_roundings_on_the_gpu():
    """The same in Triton, which contracts a float32 product into an addition it feeds where it
    may (inductor's kernels allow FMA fusion): the product is taken behind the remainder's
    select (clip.remainder with its multiplier)."""
    _fold_keeps_two_roundings("cuda")


def test_layer_output_is_clamped_gemm_plus_compensation():
    torch.manual_seed(3)
    x = heavy_tailed(64, 128, seed=3)
    w = torch.randn(32, 128) * 0.1
    y = {}
    for comp in (True, False):
        r = recipes.get("fp4-occ:occ.compensation_format=fp32")
        r = dataclasses.replace(r, occ=dataclasses.replace(r.occ, compensate=comp))
        layer = QuantLinear(128, 32, bias=False, recipe=r, backend="emulated")
        layer.weight.data.copy_(w)
        y[comp] = layer(x).double()
    lo, hi = thresholds(x, OCCConfig(threshold="exact"))
    x_c = clamp(x, lo, hi)
    xq, wq = quantize(x_c, "e2m1", "row"), quantize(w, "e2m1", "row")
    main = (xq.values.double() @ wq.values.double().t()) * (
        xq.scale.double() * wq.scale.double().t()
    )
    comp = (x.double() - x_c.double()) @ w.double().t()
    # E2M1 x E2M1 sums are exact in fp32, so only the scale products round (~1e-7 relative); the
    # compensation adds a dense fp32 GEMM of Δx, mostly zeros (measured <= 8% of tol).
    torch.testing.assert_close(y[False], main, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y[True], main + comp, rtol=1e-6, atol=1e-5)
    exact = x.double() @ w.double().t()
    assert sqnr_db(exact, y[True]) > sqnr_db(exact, y[False]) + 3  # measured +10.4 dB


def test_wgrad_gets_compensation_term_and_dgrad_is_ste():
    torch.manual_seed(4)
    x = heavy_tailed(64, 128, seed=4).requires_grad_()
    w = torch.randn(32, 128) * 0.1
    dy = torch.randn(64, 32)
    grads = {}
    for name in ("fp4-occ:occ.compensation_format=fp32", "fp4-direct"):
        layer = QuantLinear(128, 32, bias=False, recipe=name, backend="emulated")
        layer.weight.data.copy_(w)
        x.grad = None
        layer(x).backward(dy)
        grads[name] = (x.grad.clone(), layer.weight.grad.clone())
    # dgrad does not depend on the clamp (same fold, same quantized weight)
    occ_grads = grads["fp4-occ:occ.compensation_format=fp32"]
    assert torch.equal(occ_grads[0], grads["fp4-direct"][0])
    # wgrad: quantized-x part on x_c plus dyᵀ·Δx on the outlier columns
    lo, hi = thresholds(x.detach(), OCCConfig(threshold="exact"))
    x_c = clamp(x.detach(), lo, hi)
    xq = quantize(x_c, "e2m1", "row")
    h = (dy * xq.scale).t()
    hq = quantize(h, "e5m2", "row")
    delta = x.detach().double() - x_c.double()
    dw_ref = (hq.values.double() @ xq.values.double()) * hq.scale.double()
    dw_ref = dw_ref + dy.double().t() @ delta
    # Two fp32 GEMMs over 64 tokens, summed in any order: |error| <= (64 + 4) u sum|terms|, plus
    # the final add (measured <= 2% of it; a fixed rtol = atol = 1e-5 reached 76% on other seeds).
    terms = (hq.values.double().abs() @ xq.values.double().abs()) * hq.scale.double()
    terms = terms + dy.double().abs().t() @ delta.abs()
    bound = (64 + 4) * 2.0**-24 * terms + 2.0**-24 * dw_ref.abs()
    assert bool(((occ_grads[1].double() - dw_ref).abs() <= bound).all())


@pytest.mark.parametrize("k", [512, 2048])
def test_e4m3_compensation_within_half_a_db_of_fp32(k):
    """The issue's target on benchmarks/recipe_sqnr.py's kind of input (Student-t activations
    with outlier channels): y's SQNR with the E4M3 compensation (and sampled thresholds) within
    0.5 dB of the exact fp32 one (measured -0.34 dB at k=512, -0.16 dB at k=2048); dw keeps most
    of the fp32 compensation's gain over none (measured 21.7 vs 23.6 vs 2.6 dB at k=1024)."""
    x = synthetic_activation(512, k, seed=1)
    w = synthetic_weight(256, k, seed=2)
    dy = torch.randn(512, 256, generator=torch.Generator().manual_seed(3))
    ref_x, ref_w = x.double().requires_grad_(), w.double().requires_grad_()
    (ref_x @ ref_w.t()).backward(dy.double())
    sqnr = {}
    for comp in ("e4m3", "fp32", "off"):
        name = (
            "fp4-occ:occ.compensate=off"
            if comp == "off"
            else f"fp4-occ:occ.compensation_format={comp}"
        )
        layer = QuantLinear(k, 256, bias=False, recipe=name, backend="emulated")
        layer.weight.data.copy_(w)
        y = layer(x)
        y.backward(dy)
        sqnr[comp] = (
            sqnr_db(ref_x.detach() @ ref_w.detach().t(), y),
            sqnr_db(ref_w.grad, layer.weight.grad),
        )
    assert sqnr["e4m3"][0] >= sqnr["fp32"][0] - OCC_Y_VS_FP32_DB, sqnr
    assert sqnr["e4m3"][1] >= sqnr["off"][1] + OCC_DW_OVER_NONE_DB, sqnr
    # dw through the E4M3 fold (one rounding of z = x_q + Δx·m_x) against the exact fp32
    # correction GEMM
    assert sqnr["e4m3"][1] >= sqnr["fp32"][1] - OCC_DW_VS_FP32_DB, sqnr


@pytest.mark.parametrize("k", [512, 2048])
def test_one_gemm_compensation_matches_the_separate_gemm(k):
    """`OCCConfig.one_gemm` (the default) on the issue's kind of input: y within
    OCC_ONE_GEMM_VS_SEPARATE_DB of the separate E4M3 GEMM (tolerances.py), and far above no
    compensation."""
    x = synthetic_activation(512, k, seed=1)
    w = synthetic_weight(256, k, seed=2)
    y_ref = x.double() @ w.double().t()
    db = {}
    for name in ("fp4-occ", "fp4-occ:occ.one_gemm=off", "fp4-occ:occ.compensate=off"):
        layer = QuantLinear(k, 256, bias=False, recipe=name, backend="emulated")
        layer.weight.data.copy_(w)
        with torch.no_grad():
            db[name] = sqnr_db(y_ref, layer(x))
    one, sep = db["fp4-occ"], db["fp4-occ:occ.one_gemm=off"]
    assert one >= sep - OCC_ONE_GEMM_VS_SEPARATE_DB, db
    assert one >= db["fp4-occ:occ.compensate=off"] + 10.0, db


@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_x_q_values_recomputed_from_x_are_the_quantizers(granularity):
    """occ.clamped_grid_values, eagerly and compiled, gives the values of the E2M1 "inv"
    quantizer's bytes, signed zeros and non-finite rows included; the joint operand and the
    fold give the same bytes from it as from those bytes (occ_gemm passes None for them)."""
    from minifloat.kernels.operand import quantize_operand
    from minifloat.occ import clamped_grid_values

    x = heavy_tailed(64, 256, seed=77)
    x[1, :8] = -0.0
    if granularity == "row":  # one scale for all of x would make every value NaN
        x[2, 3], x[3, 5] = float("nan"), float("inf")
        x[4, 7] = 3e38  # finite, but its remainder times m_x overflows
    lo, hi = thresholds(x, OCCConfig(threshold="exact"))
    values, scale, m = quantize_operand(
        x, "e2m1", granularity, clip=(lo, hi), scale_format="inv", with_multiplier=True
    )
    want = values.float()
    assert torch.isnan(want).float().mean() < 0.05  # the non-finite rows only
    for grid in (clamped_grid_values, torch.compile(clamped_grid_values)):
        assert bits_equal(grid(x, lo, hi, m), want)
    folds = [fold_remainder(x, lo, hi, v, scale, m, 6.0) for v in (values, None)]
    assert torch.equal(folds[0][0].view(torch.uint8), folds[1][0].view(torch.uint8))
    assert torch.equal(folds[0][1], folds[1][1])
    compiled = torch.compile(fold_remainder)(x, lo, hi, None, scale, m, 6.0)
    assert same_e4m3(compiled[0], folds[0][0])
    if granularity == "row":
        joints = [joint_lhs(x, lo, hi, v, m, scale) for v in (values, None)]
        joints.append(torch.compile(joint_lhs)(x, lo, hi, None, m, scale))
        assert bool((joints[0][0].view(torch.uint8) & 0x7F == 0x7F).any())  # the NaN row
        # the row whose remainder overflows on x_q's scale: g = 0, so its E2M1 half is zeros
        # and its remainder NaN where it overflowed, zeros elsewhere
        row, k = joints[0][0][4].float(), x.shape[1]
        assert not bool(row[:k].any()) and bool(torch.isnan(row[k + 7]))
        assert not bool(row[k:].nan_to_num().any())
        assert torch.equal(joints[1][0].view(torch.uint8), joints[0][0].view(torch.uint8))
        for vals, s in joints[1:]:
            assert same_e4m3(vals, joints[0][0]) and bits_equal(s, joints[0][1])
    with pytest.raises(ValueError, match="'inv' x_q"):
        clamped_grid_values(x, lo, hi, None)
    with pytest.raises(ValueError, match="'inv' x_q"):
        fold_remainder(x, lo, hi, None, scale, None, 6.0)


def test_sample_stride_refuses_bad_sizes():
    # row_len 0: every stride divides it, and the search for one that does not never ended
    with pytest.raises(ValueError, match="row_len must be >= 1"):
        sample_stride(10_000, 0, 1024)
    with pytest.raises(ValueError, match="sample_size must be >= 1"):
        sample_stride(10_000, 64, 0)


def test_steps_passed_refuses_a_negative_count():
    with pytest.raises(ValueError, match="count >= 0"):  # returned -3 steps passed
        steps_passed(torch.tensor([500.0]), 0, -3)


def test_thresholds_refuse_a_non_config_and_0dim_x():
    with pytest.raises(TypeError, match="cfg must be an OCCConfig"):
        thresholds(torch.randn(4, 4), None)
    with pytest.raises(ValueError, match="at least 1 dim"):
        thresholds(torch.tensor(1.0), OCCConfig())


@pytest.mark.parametrize("fmt", ["bf16", "FP32"])
def test_compensation_refuses_unknown_formats(fmt):
    # any name but "fp32" was computed as "e4m3"
    x, w = torch.randn(8, 32), torch.randn(4, 32)
    clip = thresholds(x, OCCConfig())
    with pytest.raises(ValueError, match="compensation fmt must be one of"):
        occ_gemm.fprop_correction(EmulatedBackend(), fmt, x, clip, w, False)
    with pytest.raises(ValueError, match="compensation fmt must be one of"):
        occ_gemm.remainder_wgrad_operand(EmulatedBackend(), fmt, x, clip)
