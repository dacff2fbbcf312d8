"""exact.py: float32 arithmetic with the same bits eager and compiled."""

from __future__ import annotations

import pytest
import torch

from bits import bits_equal
from minifloat.exact import div_rn_by_scale, round_to_bf16, to_dtype


def _probe() -> torch.Tensor:
    """Random magnitudes over fp32's range, bf16 ties (both parities), subnormals, the edges."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen) * torch.exp2(
        torch.randint(-140, 127, (4096,), generator=gen).float()
    )
    bf = torch.randn(512, generator=gen).to(torch.bfloat16).float()
    ties = bf + torch.ldexp(torch.ones_like(bf), torch.frexp(bf)[1] - 9)  # halfway to the next
    big = torch.finfo(torch.bfloat16).max
    edges = torch.tensor(
        [0.0, -0.0, 1e-45, -1e-45, 1e-40, big, -big, 3.4e38, -3.4e38, float("inf"), -float("inf")]
    )
    return torch.cat([x, ties, -ties, edges, torch.tensor([float("nan")])])


def test_round_to_bf16_equals_the_cast():
    x = _probe()
    assert bits_equal(round_to_bf16(x), x.to(torch.bfloat16).float())


def test_compiled_round_trip_keeps_the_rounding():
    # inductor drops a plain .to(bf16).to(fp32) inside one kernel; to_dtype's must survive
    x = _probe()

    def trip(t):
        return to_dtype(t * 1.0, torch.bfloat16).float() * 1.0

    assert bits_equal(torch.compile(trip)(x), x.to(torch.bfloat16).float())


def test_div_rn_by_scale_equals_the_correctly_rounded_quotient():
    """Group scales [R, 1] over [R, C]: the fp32 quotient eager division gives (correctly
    rounded), compiled too; zero, inf and NaN scales as division treats them."""
    x = _probe()[:4096].reshape(64, 64)
    gen = torch.Generator().manual_seed(1)
    scale = torch.rand(64, 1, generator=gen) * torch.exp2(
        torch.randint(-60, 60, (64, 1), generator=gen).float()
    )
    scale[:4, 0] = torch.tensor([0.0, float("inf"), float("nan"), 1e-40])
    want = x / scale  # eager CPU division is IEEE round-to-nearest
    normal = want.abs() >= torch.finfo(torch.float32).tiny  # subnormal quotients: see div_rn
    got = div_rn_by_scale(x, scale)
    assert bits_equal(torch.where(normal, got, want), want)
    compiled = torch.compile(div_rn_by_scale, fullgraph=True)(x, scale)
    assert bits_equal(compiled, got)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reciprocal_op_on_cuda_equals_aten_eager_and_compiled():
    """The op gives ATen's float64 reciprocal bit for bit on CUDA, for strided scales and the
    special values; div_rn_by_scale on CUDA, compiled, equals eager and the float64 quotient."""
    scale = torch.rand(300, 7, device="cuda") * torch.exp2(
        torch.randint(-120, 120, (300, 7), device="cuda").float()
    )
    scale[0, :4] = torch.tensor([0.0, float("inf"), float("nan"), 1e-40])
    op = torch.ops.minifloat.reciprocal_f64.default
    for b in (scale, scale.t(), scale[:, :1], scale.reshape(1, -1)):
        got, want = op(b).cpu(), b.double().reciprocal().cpu()
        assert got.dtype == torch.float64 and torch.equal(got.isnan(), want.isnan())
        keep = ~want.isnan()
        assert torch.equal(got[keep].view(torch.int64), want[keep].view(torch.int64))
    x = (torch.randn(300, 512, device="cuda") * 100).float()
    s = x.abs().amax(dim=1, keepdim=True) / 6.0
    eager = div_rn_by_scale(x, s)
    assert bits_equal(torch.compile(div_rn_by_scale, fullgraph=True)(x, s), eager)
    assert bits_equal(eager, (x.double() * s.double().reciprocal()).float())
