"""models/swiglu.py: silu(g)·u with one float32 sigmoid, its gradients, dtypes, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minifloat.models.swiglu import swiglu

SHAPES = [(7,), (4, 33), (2, 3, 64)]


def _inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = (torch.randn(shape, generator=gen) * 4).to(dtype)  # |g| up to ~20: both tails of σ
    u = torch.randn(shape, generator=gen).to(dtype)
    dh = torch.randn(shape, generator=gen).to(dtype)
    return g, u, dh


def _reference(g, u, dh):
    """h, dg, du in float64 from the same (rounded) inputs, and the magnitudes their float32
    evaluation errs against (dg's sum 1 + g·(1 - s) cancels near g = -1.28)."""
    g64, u64, dh64 = (t.double() for t in (g, u, dh))
    s = torch.sigmoid(g64)
    values = (g64 * s * u64, dh64 * u64 * s * (1 + g64 * (1 - s)), dh64 * g64 * s)
    dg_terms = (dh64 * u64 * s).abs() * (1 + (g64 * (1 - s)).abs())
    return values, (values[0].abs(), dg_terms, values[2].abs())


def _run(fn, g, u, dh):
    g, u = g.clone().requires_grad_(True), u.clone().requires_grad_(True)
    h = fn(g, u)
    h.backward(dh)
    return h, g.grad, u.grad


def test_gradients_match_autograd_of_silu_in_float64():
    g, u, _ = _inputs((5, 16), torch.float64)
    assert torch.autograd.gradcheck(swiglu, (g.requires_grad_(), u.requires_grad_()))
    dh = torch.randn(5, 16, dtype=torch.float64)
    ours = _run(swiglu, g.detach(), u.detach(), dh)
    aten = _run(lambda a, b: F.silu(a) * b, g.detach(), u.detach(), dh)
    for a, b in zip(ours, aten, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rounded_once(shape, dtype):
    """bf16 and fp16 outputs are the float64 value rounded once (half a unit in the last
    place), up to the float32 work's own error (2^-20 of the terms' magnitude); float32 ones
    carry that work's error alone (a few units in the last place of the terms)."""
    g, u, dh = _inputs(shape, dtype)
    got = _run(swiglu, g, u, dh)
    once = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps / 2
    values, terms = _reference(g, u, dh)
    for out, ref, mag in zip(got, values, terms, strict=True):
        assert out.dtype == dtype
        err = (out.detach().double() - ref).abs()
        bound = ref.abs() * once + mag * 2.0**-20 + torch.finfo(dtype).tiny
        assert (err <= bound).all(), float((err - bound).max())


def test_more_accurate_than_eager_silu_in_bf16():
    """Eager `F.silu(g) * u` rounds silu(g) to bf16 before the product; this form does not."""
    g, u, dh = _inputs((1 << 14,), torch.bfloat16)
    rounded = [r.bfloat16() for r in _reference(g, u, dh)[0]]  # correctly rounded
    ours = _run(swiglu, g, u, dh)
    aten = _run(lambda a, b: F.silu(a) * b, g, u, dh)
    wrong = [[int((t != r).sum()) for t, r in zip(o, rounded, strict=True)] for o in (ours, aten)]
    assert all(a <= b for a, b in zip(*wrong, strict=True)), wrong
    assert sum(wrong[0]) <= 0.001 * 3 * g.numel() < sum(wrong[1]), wrong


def test_saves_only_g_and_u():
    g, u, _ = _inputs((8, 32), torch.bfloat16)
    g.requires_grad_(True)
    u.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        swiglu(g, u)
    assert len(saved) == 2
    assert {t.data_ptr() for t in saved} == {g.data_ptr(), u.data_ptr()}


def test_dtype_promotes_as_the_product_does():
    g, u, _ = _inputs((4, 8), torch.float32)
    assert swiglu(g.bfloat16(), u).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert swiglu(g.bfloat16(), u.bfloat16()).dtype == torch.bfloat16


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _CUDA])])
def test_compiled_close_to_eager(device, dtype):
    """Compiled, the sigmoid's exp may differ in its last bits (a model op, not a quantizer):
    the outputs agree to one bf16 rounding. float32: under torch 2.11 (CPU and CUDA) the
    compiled backward got zeros for dh while the forward ended in a no-op `.to` (session 80)."""
    g, u, dh = (t.to(device) for t in _inputs((64, 96), dtype))
    torch._dynamo.reset()
    compiled = _run(torch.compile(swiglu, fullgraph=True), g, u, dh)
    eager = _run(swiglu, g, u, dh)
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-6)


def test_bad_inputs():
    g = torch.randn(3, 4)
    with pytest.raises(ValueError, match="one shape"):
        swiglu(g, torch.randn(4, 3))
    with pytest.raises(TypeError, match="floating-point"):
        swiglu(g.long(), g.long())
