"""models/rope.py: RoPE as one autograd Function, whose backward (eager, compiled, and the
compiled CUDA kernel) equals eager autograd of the plain rotate-half form bit for bit."""

from __future__ import annotations

import pytest
import torch

from minifloat.models import rope
from minifloat.models.rope import apply_rope, rope_cos_sin, rope_grad

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# [B, H, T, D] and whether x is a transposed view of [B, T, H, D] (as the attention block's)
SHAPES = [((2, 3, 33, 8), False), ((2, 3, 33, 64), True), ((1, 4, 17, 128), True),
          ((2, 2, 5, 96), False)]  # fmt: skip


def _plain(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The form before the Function (and Hugging Face's): autograd differentiates it."""
    x_fp32 = x.float()
    first, second = x_fp32.chunk(2, dim=-1)
    return (x_fp32 * cos + torch.cat((-second, first), dim=-1) * sin).to(x.dtype)


def _inputs(shape, transposed, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, h, t, d = shape
    if transposed:
        x = torch.randn(b, t, h, d, generator=gen).mul(3).to(dtype).transpose(1, 2)
    else:
        x = torch.randn(b, h, t, d, generator=gen).mul(3).to(dtype)
    g = torch.randn(b, h, t, d, generator=gen).to(dtype)
    if transposed:  # as SDPA's backward returns it: the strides of its input
        g = g.transpose(1, 2).contiguous().transpose(1, 2)
    cos, sin = rope_cos_sin(t, d, 10000.0)
    return x.to(device), g.to(device), cos.to(device), sin.to(device)


def _both(fn, x, g, cos, sin):
    """(out, dx) of fn and of the plain form under eager autograd."""
    results = []
    for f in (fn, _plain):
        leaf = x.detach().clone().requires_grad_()
        out = f(leaf, cos, sin)
        out.backward(g)
        results.append((out, leaf.grad))
    return results


@pytest.mark.parametrize("shape,transposed", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_equals_autograd_of_the_plain_form(shape, transposed, dtype):
    (out, dx), (want_out, want_dx) = _both(apply_rope, *_inputs(shape, transposed, dtype))
    assert out.dtype == dtype and dx.dtype == dtype
    assert torch.equal(out, want_out)
    assert torch.equal(dx, want_dx)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_equals_autograd_of_the_plain_form(dtype):
    x, g, cos, sin = _inputs((2, 3, 33, 64), True, dtype)
    (out, dx), (want_out, want_dx) = _both(torch.compile(apply_rope), x, g, cos, sin)
    assert torch.equal(out, want_out)
    assert torch.equal(dx, want_dx)


def test_rope_grad_is_the_transposed_rotation():
    """dx = R(-θ) g: rotating the gradient back by the same angles (the rotation's transpose),
    against float64."""
    x, g, cos, sin = _inputs((1, 2, 9, 16), False, torch.float64)
    want = _plain(g, cos.double(), -sin.double())
    torch.testing.assert_close(rope_grad(g, cos, sin), want, rtol=0, atol=1e-6)


def test_tables_that_require_grad_get_it():
    x, g, cos, sin = _inputs((1, 2, 5, 8), False, torch.float32)
    sin = sin.clone().requires_grad_()
    apply_rope(x, cos, sin).backward(g)
    assert sin.grad is not None and sin.grad.abs().sum() > 0


def test_backward_keeps_nothing_but_the_tables():
    x, g, cos, sin = _inputs((1, 2, 5, 8), False, torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        apply_rope(x.requires_grad_(), cos, sin)
    assert [s.data_ptr() for s in saved] == [cos.data_ptr(), sin.data_ptr()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape,transposed", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_kernel_equals_rope_grad(shape, transposed, dtype):
    """The compiled backward's kernel (launched eagerly here, on the layout the Function hands
    it) and the compiled Function, against the eager plain form on the GPU."""
    x, g, cos, sin = _inputs(shape, transposed, dtype, "cuda")
    rows = g.transpose(1, 2) if transposed else g  # contiguous either way
    seq_dim, inner = (1, shape[1]) if transposed else (2, 1)
    assert rope._kernel_fits(rows, cos, sin, seq_dim)
    dx = torch.ops.minifloat.rope_grad_traced.default(rows, cos, sin, inner)
    assert dx.is_contiguous()
    tables = (cos.unsqueeze(-2), sin.unsqueeze(-2)) if transposed else (cos, sin)
    assert torch.equal(dx, rope_grad(rows, *tables))
    (out, dx_c), (want_out, want_dx) = _both(torch.compile(apply_rope), x, g, cos, sin)
    assert torch.equal(dx_c, want_dx)
    # the compiled forward is inductor's (it may contract a product into an FMA): close only
    torch.testing.assert_close(out, want_out)
