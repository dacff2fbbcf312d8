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


def _inputs(shape, transposed, dtype, device="cpu", seed=0, tables="rope"):
    """x, g (in SDPA's layout for `transposed`), cos, sin: `rope_cos_sin`'s tables (equal
    halves) or, for "random", tables whose halves differ (a swapped half would show)."""
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
    if tables == "random":
        cos, sin = torch.randn(t, d, generator=gen), torch.randn(t, d, generator=gen)
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


@pytest.mark.parametrize("tables", ["rope", "random"])
@pytest.mark.parametrize("shape,transposed", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_equals_autograd_of_the_plain_form(shape, transposed, dtype, tables):
    inputs = _inputs(shape, transposed, dtype, tables=tables)
    (out, dx), (want_out, want_dx) = _both(apply_rope, *inputs)
    assert out.dtype == dtype and dx.dtype == dtype
    assert torch.equal(out, want_out)
    assert torch.equal(dx, want_dx)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_equals_autograd_of_the_plain_form(dtype):
    """On the CPU the compiled Function runs `rope_grad` through inductor's C++ (no FMA
    contraction by default): this checks the layouts and the Function under dynamo; the
    kernel's path is the GPU test's."""
    x, g, cos, sin = _inputs((2, 3, 33, 64), True, dtype, tables="random")
    (out, dx), (want_out, want_dx) = _both(torch.compile(apply_rope), x, g, cos, sin)
    assert torch.equal(out, want_out)
    assert torch.equal(dx, want_dx)


def test_rope_grad_is_the_transposed_rotation():
    """dx = R(-θ) g: rotating the gradient back by the same angles (the rotation's transpose),
    against float64."""
    x, g, cos, sin = _inputs((1, 2, 9, 16), False, torch.float64)
    want = _plain(g, cos.double(), -sin.double())
    torch.testing.assert_close(rope_grad(g, cos, sin), want, rtol=0, atol=1e-6)


def test_broadcast_to_a_larger_shape_takes_the_plain_form():
    """x [1, 2, 1, 8] rotated at 5 positions: the output (and so g) is larger than x, and
    autograd's sum over the broadcast dim must see float32 terms, as the plain form's does."""
    x, g, cos, sin = _inputs((1, 2, 5, 8), False, torch.bfloat16, tables="random")
    (out, dx), (want_out, want_dx) = _both(apply_rope, x[:, :, :1], g, cos, sin)
    assert out.shape == (1, 2, 5, 8) and dx.shape == (1, 2, 1, 8)
    assert torch.equal(out, want_out) and torch.equal(dx, want_dx)


def test_odd_head_dim_is_refused():
    x = torch.randn(1, 1, 3, 5)
    cos, sin = torch.ones(3, 5), torch.zeros(3, 5)
    with pytest.raises(ValueError, match="odd size 5"):
        apply_rope(x, cos, sin)


@pytest.mark.parametrize(
    ("args", "match"),
    [((8, 5, 1e4), "even head_dim >= 2, got 5"), ((8, 8, 0.0), "theta must be positive"),
     ((8, 8, float("nan")), "theta must be positive and finite, got nan")],
)  # fmt: skip
def test_tables_refuse_what_gives_wrong_shapes_or_nan(args, match):
    """head_dim 5 gave [8, 6] tables; theta 0 or NaN gave NaN tables, without an error."""
    with pytest.raises(ValueError, match=match):
        rope_cos_sin(*args)


def test_integer_x_is_refused():
    cos, sin = rope_cos_sin(3, 4, 1e4)
    with pytest.raises(TypeError, match="floating-point x, got torch.int64"):
        apply_rope(torch.ones(1, 1, 3, 4, dtype=torch.int64), cos, sin)


def test_tables_that_require_grad_get_it():
    x, g, cos, sin = _inputs((1, 2, 5, 8), False, torch.float32)
    sin = sin.clone().requires_grad_()
    apply_rope(x, cos, sin).backward(g)
    assert sin.grad is not None and sin.grad.abs().sum() > 0


@pytest.mark.parametrize("transposed", [False, True])
def test_backward_keeps_nothing_but_the_tables(transposed):
    x, g, cos, sin = _inputs((1, 2, 5, 8), transposed, torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        apply_rope(x.requires_grad_(), cos, sin)
    assert [s.data_ptr() for s in saved] == [cos.data_ptr(), sin.data_ptr()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tables", ["rope", "random"])
@pytest.mark.parametrize("shape,transposed", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_kernel_equals_rope_grad(shape, transposed, dtype, tables):
    """The compiled backward's kernel (launched eagerly here, on the layout the Function hands
    it) and the compiled Function, whose backward must launch it, against the eager plain form
    on the GPU."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()  # a compile of its own (past the recompile limit dynamo runs eager)
    x, g, cos, sin = _inputs(shape, transposed, dtype, "cuda", tables=tables)
    rows = g.transpose(1, 2) if transposed else g  # contiguous either way
    seq_dim, inner = (1, shape[1]) if transposed else (2, 1)
    assert rope._kernel_fits(rows, cos, sin, seq_dim)
    dx = torch.ops.minifloat.rope_grad_traced.default(rows, cos, sin, inner)
    assert dx.is_contiguous()
    tables_ = (cos.unsqueeze(-2), sin.unsqueeze(-2)) if transposed else (cos, sin)
    assert torch.equal(dx, rope_grad(rows, *tables_))
    ((out, dx_c), (want_out, want_dx)), code = run_and_get_code(
        _both, torch.compile(apply_rope), x, g, cos, sin
    )
    assert any("_rope_grad_kernel" in c for c in code)
    assert torch.equal(dx_c, want_dx)
    # the compiled forward is inductor's (it may contract a product into an FMA): close only
    torch.testing.assert_close(out, want_out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_takes_only_what_it_fits():
    g = torch.randn(2, 5, 3, 8, device="cuda", dtype=torch.bfloat16)
    cos, sin = (t.cuda() for t in rope_cos_sin(5, 8, 10000.0))
    assert rope._kernel_fits(g, cos, sin, 1)
    assert not rope._kernel_fits(g, cos, sin, 2)  # T is dim 1 here
    assert not rope._kernel_fits(g.transpose(1, 2), cos, sin, 2)  # not contiguous
    assert not rope._kernel_fits(g, cos[:1], sin[:1], 1)  # [1, D] tables broadcast over T
    assert not rope._kernel_fits(g, cos[None, :, None], sin[None, :, None], 1)
    assert not rope._kernel_fits(g, cos.bfloat16(), sin.bfloat16(), 1)
    assert not rope._kernel_fits(g, cos[:, :4], sin[:, :4], 1)
