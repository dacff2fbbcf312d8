"""occ.joint_lhs and occ.joint_rhs: fprop's operands with OCC's compensation in one GEMM over
2K (docs/recipes.md, "one GEMM"): the row factors g = f·2^-a that keep x_q's E2M1 values exact,
the remainder on x_q's scale over g, and the rows past every factor's range."""

from __future__ import annotations

import math

import pytest
import torch

from bits import bits_equal, same_e4m3
from minifloat import occ as occ_module
from minifloat.occ import clamp, joint_lhs, joint_rhs, remainder, thresholds
from minifloat.quantize import quantize
from minifloat.recipes import OCCConfig
from minifloat.sqnr import synthetic_activation, synthetic_weight


def test_joint_factors_keep_every_e2m1_value_exact():
    """Every row multiplier g = f·2^-a that joint_lhs may take (occ._JOINT_FACTORS) carries
    every E2M1 value exactly into E4M3, and the next shift past each end would not."""
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    e2m1 = torch.cat([e2m1, -e2m1])

    def exact(g: float) -> bool:
        v = e2m1 * g
        return v.abs().max() <= 448.0 and torch.equal(v.float().to(torch.float8_e4m3fn).double(), v)

    for f, least, most in occ_module._JOINT_FACTORS:
        assert all(exact(f * 2.0**-a) for a in range(least, most + 1)), f
        assert not exact(f * 2.0 ** -(least - 1)) and not exact(f * 2.0 ** -(most + 1)), f


@pytest.mark.parametrize("center", [3.0, 1.5 * 2.0**-3, 6.0 * 2.0**5, 0.75])
def test_joint_factor_takes_the_smaller_f_across_a_tie(center):
    """Where two factors round the row's largest remainder to the same value (3 is E4M3's
    with f = 1, 1.25 and 1.5: 3.75 and 4.5 are E4M3 values too), the factors are tied however
    float32 rounds their errors, and f = 1 is taken throughout: with the errors compared as
    computed, a change of reach's last bits flipped f in such rows and rounded the row's
    remainder anew (session 82, `benchmarks/occ_factor_flip_probe.py`)."""
    k = torch.arange(-2000, 2001, dtype=torch.float64)
    reach = (center * (1 + k * 2.0**-22)).float().reshape(-1, 1)
    f, f_inv = occ_module._joint_factor(reach)
    assert torch.equal(f, torch.ones_like(f)) and torch.equal(f_inv, torch.ones_like(f))


def test_joint_operands_keep_the_e2m1_halves_exact():
    """joint_lhs / joint_rhs: the E2M1 halves are x_q's and w_q's values times one multiplier
    g per row (so the main product is fp4's own), g = f·2^-a with f in {1, 1.25, 1.5} and a
    the least in f's range that holds the row's remainder, f the one that rounds the row's
    largest remainder closest; the remainder half is Δx·m_x·g on E4M3; a row whose remainder
    passes 448·2^8 takes a past f's range (its E2M1 half then rounded), never ±448."""
    x = synthetic_activation(128, 256, seed=4)
    x[0, 0] = 1e9  # a row whose remainder needs more than 2^8
    lo, hi = thresholds(x, OCCConfig(threshold="exact"))
    q = quantize(clamp(x, lo, hi), "e2m1", "row", scale_format="inv")
    m_x = (6.0 / clamp(x, lo, hi).abs().amax(1, keepdim=True).double()).float()
    a_vals, a_scale = joint_lhs(x, lo, hi, q.values.to(torch.float8_e4m3fn), m_x, q.scale)
    assert a_vals.shape == (128, 512) and a_vals.dtype == torch.float8_e4m3fn
    main = a_vals[1:, :256].double()
    nz = q.values[1:] != 0
    g = (main.abs().sum(1) / q.values[1:].double().abs().sum(1)).unsqueeze(1)  # one per row
    assert torch.equal(main, q.values[1:].double() * g) and bool(nz.any(1).all())
    rel = (a_scale[1:].double() * g / q.scale[1:].double() - 1).abs()
    assert bool((rel <= 2.0**-22).all())  # the scale is x_q's over g, rounded
    g = torch.cat([torch.ones(1, 1, dtype=g.dtype), g])  # row 0 below
    reach = (remainder(x, lo, hi) * m_x).abs().amax(1, keepdim=True).double()
    e4m3 = lambda v: v.clamp(max=448.0).float().to(torch.float8_e4m3fn).double()  # noqa: E731
    for row in range(1, 128):
        options = {}
        for f, least, most in occ_module._JOINT_FACTORS:
            a = least
            while reach[row].item() * f * 2.0**-a > 448.0 and a < most:
                a += 1
            top = reach[row] * f * 2.0**-a
            options[f * 2.0**-a] = ((e4m3(top) - top).abs() * 2.0**a / f).item()
        best = min(options.values())
        assert options.get(g[row].item(), float("inf")) <= best * (1 + 2.0**-20), row
    # row 0: f = 1 (the least overshoot of its range) and a past 8, the least that holds its
    # remainder, both halves rounded from float32 on g = 2^-a
    g0 = q.scale[0].double() / a_scale[0].double()
    assert g0.item() == 2.0 ** round(math.log2(g0.item())) and g0.item() < 2.0**-8
    assert 224.0 < reach[0].item() * g0.item() <= 448.0
    want0 = torch.cat(
        [q.values[0].float() * g0.float(), remainder(x, lo, hi)[0] * m_x[0] * g0.float()]
    )
    assert torch.equal(a_vals[0].view(torch.uint8), want0.to(torch.float8_e4m3fn).view(torch.uint8))
    assert a_vals[0, 256:].double().abs().max() >= 224.0  # its E4M3 rounding
    delta = remainder(x, lo, hi)[1:].double() * m_x[1:].double() * g[1:]
    got = a_vals[1:, 256:].double()
    assert bool(((got - delta).abs() <= delta.abs() / 16 + 2.0**-9).all())

    w = synthetic_weight(64, 256, seed=5)
    wq = quantize(w, "e2m1", "row", scale_format="inv")
    m_w = (6.0 / w.abs().amax(1, keepdim=True).double()).float()
    b_vals, b_scale = joint_rhs(w, wq.values.to(torch.float8_e4m3fn), m_w, wq.scale)
    assert torch.equal(b_scale * 64.0, wq.scale)
    assert torch.equal(b_vals[:, :256].double() / 64.0, wq.values.double())
    exact = w.double() * m_w.double() * 64.0
    assert bool(((b_vals[:, 256:].double() - exact).abs() <= exact.abs() / 16 + 2.0**-10).all())


def _joint_lhs_compiled_past_its_range(device: str) -> None:
    """joint_lhs eagerly and compiled on `device` gives the same bytes on rows past every
    factor's range (remainders 1e9, -2e7 and 1e37 of x's scale), one whose remainder overflows
    on x_q's scale (3e38), a NaN row, and rows just past f = 1.25's and f = 1.5's ranges but
    inside f = 1's: no entry passes ±448, where sm_90's E4M3 conversion saturates and torch's
    eager one makes NaN (joint_lhs casts without the selects that made them agree). Rows past
    every range take f = 1 and the least a that holds them, their bytes both halves rounded
    from float32 on g = 2^-a; the edge rows take f = 1 inside its range, their E2M1 half exact."""
    x = synthetic_activation(64, 256, seed=78) * 0.5  # clip bound ~3: m_x ~2, 3e38·m_x inf
    x[0, 0], x[1, 9], x[2, 3], x[5, 1], x[6, 4] = 1e9, 3e38, float("nan"), -2e7, 1e37
    x[7, 1] = x[8, 2] = 1e4  # past the clip bound: the bounds and m_x stay as they are below
    lo, hi = thresholds(x, OCCConfig(threshold="exact"))
    m_x = (6.0 / clamp(x, lo, hi).abs().amax(1, keepdim=True).double()).float()
    edges = {7: 448.0 * 2**6 / 1.25, 8: 448.0 * 2**7 / 1.5}  # f's range ends, x_q's scale
    for row, edge in edges.items():  # 1 % past the end: reach = Δx·m_x
        x[row, row - 6] = hi + edge * 1.01 / m_x[row, 0]
    q = quantize(clamp(x, lo, hi), "e2m1", "row", scale_format="inv")
    args = [v.to(device) for v in (x, lo, hi)] + [None, m_x.to(device), q.scale.to(device)]
    eager = joint_lhs(*args)
    compiled = torch.compile(joint_lhs)(*args)
    assert same_e4m3(compiled[0], eager[0]) and bits_equal(compiled[1], eager[1])
    values, scale = eager[0].cpu(), eager[1].cpu()
    delta = values[:, 256:].float()
    assert bool(delta[1, 9].isnan()) and not bool(delta[1].nan_to_num().any())  # g = 0
    finite = torch.ones(64, dtype=torch.bool)
    finite[[1, 2]] = False
    assert not bool(values[finite].float().isnan().any())
    for row in (0, 5, 6, 7, 8):
        g = (q.scale[row] / scale[row]).item()  # f = 1: a power of two, exact
        assert g == 2.0 ** round(math.log2(g)), row
        reach = (remainder(x, lo, hi)[row] * m_x[row]).abs().max().item()
        assert 224.0 < reach * g <= 448.0 and delta[row].abs().max() >= 224.0, row  # kept
        want = torch.cat([q.values[row].float() * g, remainder(x, lo, hi)[row] * m_x[row] * g])
        assert torch.equal(
            values[row].view(torch.uint8), want.to(torch.float8_e4m3fn).view(torch.uint8)
        )
        if row in edges:  # inside f = 1's range: the E2M1 half exact
            assert torch.equal(values[row, :256].double(), q.values[row].double() * g), row


def test_joint_lhs_compiled_past_its_range():
    _joint_lhs_compiled_past_its_range("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_joint_lhs_compiled_past_its_range_on_the_gpu():
    """The same in Triton, whose E4M3 cast saturates where the eager one makes NaN."""
    _joint_lhs_compiled_past_its_range("cuda")
