"""exact.py: float32 arithmetic with the same bits eager and compiled."""

from __future__ import annotations

import functools

import pytest
import torch

from bits import bits_equal
from minifloat.exact import as_dtype, div_rn_by_scale, round_to_bf16, to_dtype, written_once


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


@pytest.mark.parametrize("in_graph", [False, True], ids=["opaque_op", "in_graph"])
def test_div_rn_by_scale_equals_the_correctly_rounded_quotient(in_graph):
    """Group scales [R, 1] over [R, C]: the fp32 quotient eager division gives (correctly
    rounded), compiled too, with the reciprocals from the opaque op or from the graph; zero,
    inf and NaN scales as division treats them."""
    x = _probe()[:4096].reshape(64, 64)
    gen = torch.Generator().manual_seed(1)
    scale = torch.rand(64, 1, generator=gen) * torch.exp2(
        torch.randint(-60, 60, (64, 1), generator=gen).float()
    )
    scale[:4, 0] = torch.tensor([0.0, float("inf"), float("nan"), 1e-40])
    want = x / scale  # eager CPU division is IEEE round-to-nearest
    normal = want.abs() >= torch.finfo(torch.float32).tiny  # subnormal quotients: see div_rn
    got = div_rn_by_scale(x, scale, in_graph=in_graph)
    assert bits_equal(torch.where(normal, got, want), want)
    compiled = torch.compile(functools.partial(div_rn_by_scale, in_graph=in_graph), fullgraph=True)
    assert bits_equal(compiled(x, scale), got)
    assert bits_equal(compiled(x, scale.t().contiguous().t()), got)  # strided scales too


@pytest.mark.parametrize("shape", [(5,), (3, 7), (2, 3, 4)])
def test_written_once_is_the_identity_on_a_contiguous_copy(shape):
    t = torch.randn(*shape).double()
    for src in (t, t.transpose(0, -1)):
        out = written_once(src)
        assert out.is_contiguous() and torch.equal(out, src)
    compiled = torch.compile(written_once, fullgraph=True)(t.transpose(0, -1))
    assert compiled.is_contiguous() and torch.equal(compiled, t.transpose(0, -1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("in_graph", [False, True], ids=["opaque_op", "in_graph"])
def test_div_rn_by_scale_on_cuda_compiled_equals_eager(in_graph):
    """Group scales on CUDA, strided and special (zero, inf, NaN, subnormal): the compiled
    quotient (float64 reciprocals from the opaque op, or computed by a Triton kernel and
    written once) equals eager and the float64 quotient bit for bit."""
    scale = torch.rand(300, 7, device="cuda") * torch.exp2(
        torch.randint(-120, 120, (300, 7), device="cuda").float()
    )
    scale[0, :4] = torch.tensor([0.0, float("inf"), float("nan"), 1e-40])
    x = (torch.randn(300, 512, device="cuda") * 100).float()
    compiled = torch.compile(functools.partial(div_rn_by_scale, in_graph=in_graph), fullgraph=True)
    for s in (scale[:, :1], x.abs().amax(dim=1, keepdim=True) / 6.0):
        eager = div_rn_by_scale(x, s)
        assert bits_equal(compiled(x, s), eager)
        assert bits_equal(eager, (x.double() * s.double().reciprocal()).float())
    for s in (scale.t()[:, :300].reshape(1, -1)[:, :512], scale.reshape(1, -1)[:, :512]):
        assert bits_equal(compiled(x, s), div_rn_by_scale(x, s))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_as_dtype_is_the_tensor_itself_or_its_cast(dtype):
    x = torch.randn(4, 5)
    y = as_dtype(x, dtype)
    assert (y is x) == (dtype == torch.float32)
    assert y.dtype == dtype and torch.equal(y, x.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int32])
def test_round_to_bf16_refuses_other_dtypes(dtype):
    # their bits read as float32: fp16 1.0001 came back as 77.0
    with pytest.raises(TypeError, match="takes a float32 tensor"):
        round_to_bf16(torch.ones(4).to(dtype))


@pytest.mark.parametrize("dtype", ["bfloat16", None])
def test_as_dtype_refuses_a_non_dtype(dtype):
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        as_dtype(torch.ones(2), dtype)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        to_dtype(torch.ones(2), dtype)
