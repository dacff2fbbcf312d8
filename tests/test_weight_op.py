"""kernels/weight_op.py: the weight ops' registration (the eager op, its fake outputs, the traced
`triton_op` whose schema comes from the output count) and the shapes they take."""

import pytest
import torch

from minifloat.kernels import weight_op


def _reference(w: torch.Tensor, inv: bool) -> tuple[torch.Tensor, ...]:
    fp8 = torch.float8_e4m3fn
    scale = w.abs().amax().reshape(1, 1) * (2.0 if inv else 1.0)
    return w.to(fp8), w.t().contiguous().to(fp8), scale, scale + 1, w[:, :1].float().contiguous()


def _kernel(w: torch.Tensor, fmt_max: float, inv: bool, *, traced: bool = False):
    assert fmt_max == 448.0
    return _reference(w, inv)


OP = weight_op.define(
    "weight_op_test", _kernel, _reference, lambda rows, cols: [(1, 1), (1, 1), (rows, 1)]
)


def test_the_ops_take_w_and_inv_and_return_every_output():
    for name in ("weight_op_test", "weight_op_test_traced"):
        schema = getattr(torch.ops.minifloat, name).default._schema
        assert [a.name for a in schema.arguments] == ["w", "inv"]
        assert len(schema.returns) == 5


@pytest.mark.parametrize("inv", [True, False])
def test_eager_and_compiled_calls_give_the_reference(inv):
    w = torch.randn(128, 256, requires_grad=True)
    want = _reference(w.detach(), inv)
    for fn in (OP, torch.compile(OP, fullgraph=True)):  # compiled: through the fake outputs
        got = fn(w, inv)
        assert len(got) == len(want)
        for g, r in zip(got, want, strict=True):
            assert g.shape == r.shape and g.dtype == r.dtype and not g.requires_grad
            assert torch.equal(g.view(torch.uint8), r.view(torch.uint8))


def test_fits_only_2d_cuda_float_weights_of_whole_blocks():
    assert not weight_op.fits(torch.ones(256, 256))  # the CPU
    if torch.cuda.is_available():
        assert weight_op.fits(torch.ones(256, 384, device="cuda"))
        assert not weight_op.fits(torch.ones(256, 200, device="cuda"))
        assert not weight_op.fits(torch.ones(256, 256, device="cuda", dtype=torch.int32))


@pytest.mark.parametrize("shape", [(100, 128), (128, 100), (128,), (0, 128)])
def test_check_shape_names_the_op(shape):
    with pytest.raises(ValueError, match=r"my_op takes a 2-D tensor .* got shape"):
        weight_op.check_shape(torch.ones(shape), "my_op")
