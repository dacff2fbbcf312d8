"""kernels/swiglu.py: the SwiGLU backward's five tensor-scaled operands.

The reference is checked against autograd's own SwiGLU backward (float32) quantized by
`quantize_operand`; the op equals the reference on the CPU, eagerly and compiled; NaN reaches
the scales; bad input fails in one line. On a GPU the Triton kernels equal the reference as
inductor compiles it, bit for bit, over formats, ragged shapes and planted extremes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bits import bits_equal
from minifloat.kernels.operand import quantize_operand
from minifloat.kernels.swiglu import reference, swiglu_backward_tensorwise, swiglu_hp

CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
SHAPES = [(64, 128), (77, 100), (1, 33)]
FMTS = [("e4m3", "e5m2"), ("e4m3", "e4m3"), ("e5m2", "e5m2")]


def _inputs(m, n, device="cpu", dtype=torch.bfloat16, planted=False, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    g, u, dh = (torch.randn(m, n, generator=gen, device=device) for _ in range(3))
    g, u, dh = g.to(dtype), u.to(dtype), dh.to(dtype)
    if planted:  # extremes of the SiLU's exp: overflow, subnormals, signed zeros
        values = [0.0, -0.0, 3e38, -1e-40, 88.0, -88.0, 1e-3, -3e38][:n]
        g[0, : len(values)] = torch.tensor(values, dtype=dtype)
    h_scale = (swiglu_hp(g, u).abs().amax() / 448.0).reshape(1, 1)
    return g, u, dh, h_scale


def _same(a, b) -> bool:
    return all(bits_equal(x, y) and x.dtype == y.dtype and x.shape == y.shape
               for x, y in zip(a, b, strict=True))  # fmt: skip


@pytest.mark.parametrize("fmts", FMTS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_is_autograds_swiglu_backward_quantized(fmts, shape, dtype):
    g, u, dh, h_scale = _inputs(*shape, dtype=dtype)
    g32, u32 = g.float().requires_grad_(), u.float().requires_grad_()
    h = F.silu(g32) * u32
    h.backward(dh.float())
    h_t, dg_q, dg_t, du_q, du_t, s_g, s_u = reference(g, u, dh, h_scale, *fmts)
    want_h, _ = quantize_operand(h.detach(), fmts[0], "tensor", scale=h_scale)
    want_dg, want_sg = quantize_operand(g32.grad, fmts[1], "tensor")
    want_du, want_su = quantize_operand(u32.grad, fmts[1], "tensor")
    assert _same((h_t, dg_q, dg_t, du_q, du_t, s_g, s_u),
                 (want_h.t().contiguous(), want_dg, want_dg.t().contiguous(), want_du,
                  want_du.t().contiguous(), want_sg, want_su))  # fmt: skip
    assert dg_q.float().abs().amax() > 0 and s_g.shape == (1, 1)


@pytest.mark.parametrize("shape", SHAPES)
def test_op_equals_reference_eager_and_compiled(shape):
    g, u, dh, h_scale = _inputs(*shape, planted=True)
    want = reference(g, u, dh, h_scale, "e4m3", "e5m2")
    assert _same(swiglu_backward_tensorwise(g, u, dh, h_scale), want)
    compiled = torch.compile(swiglu_backward_tensorwise, fullgraph=True)
    assert _same(compiled(g, u, dh, h_scale), want)


def test_nan_reaches_the_scales():
    g, u, dh, h_scale = _inputs(16, 32)
    dh[3, 5] = float("nan")
    *_, s_g, s_u = swiglu_backward_tensorwise(g, u, dh, h_scale)
    assert s_g.isnan().all() and s_u.isnan().all()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(u=torch.zeros(4, 9)), "one shape"),
        (dict(h_fmt="e2m1"), "h_fmt must be one of"),
        (dict(grad_fmt="fp8"), "grad_fmt must be one of"),
        (dict(h_scale=torch.ones(2)), "one tensor scale"),
    ],
)
def test_bad_input_fails_in_one_line(kwargs, message):
    g, u, dh, h_scale = _inputs(4, 8)
    args = dict(g=g, u=u, dh=dh, h_scale=h_scale) | kwargs
    with pytest.raises(ValueError, match=message):
        swiglu_backward_tensorwise(**args)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 tensor cores")
@pytest.mark.parametrize("fmts", FMTS)
@pytest.mark.parametrize("shape", SHAPES + [(4096, 5632), (300, 11008)])
@pytest.mark.parametrize("planted", [False, True])
def test_triton_kernels_equal_the_compiled_reference_on_cuda(fmts, shape, planted):
    """Inductor's arithmetic (its float32 division is Triton's approximate one), not eager
    ATen's: see the module docstring of kernels/swiglu.py."""
    g, u, dh, h_scale = _inputs(*shape, device="cuda", planted=planted)
    got = swiglu_backward_tensorwise(g, u, dh, h_scale, *fmts)
    torch._dynamo.reset()  # a graph per case: no recompile limit across the parametrization
    compiled = torch.compile(reference, fullgraph=True, dynamic=False)
    assert _same(got, compiled(g, u, dh, h_scale, *fmts))
    for scale in got[-2:]:  # tensors of their own (cuBLAS needs aligned scale pointers)
        assert scale.storage_offset() == 0 and scale.untyped_storage().nbytes() == 4
