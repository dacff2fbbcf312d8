"""kernels/fold_maxima.py: the wgrad fold's column maxima max |x · s| by a Triton kernel equal
`operand._column_amax(x.float() * s)` bit for bit (NaN, inf, zeros, subnormal products), eager
and compiled; the quantizer takes them where `supports` does, and only there."""

from __future__ import annotations

import os

import pytest
import torch

from bits import bits_equal
from minifloat.kernels import fold_maxima, operand

SHAPES = [(256, 64), (512, 192), (1024, 2048)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _reference(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return operand._column_amax(x.float() * s.float()).float()


def _inputs(shape, dtype, device="cpu"):
    """x with a NaN column, an inf, a zero column, -0.0 and entries whose products with s are
    subnormal (a flush to zero would show); s positive, some tiny."""
    rows, cols = shape
    gen = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=gen).to(dtype)
    s = torch.rand(rows, 1, generator=gen) + 0.5
    x[:, 1] = 0.0
    x[3, 1] = -0.0
    x[7, 2] = float("nan")
    x[5, 3] = float("inf")
    x[:, 4] = 1e-3  # times 2^-130: subnormal in float32
    s[::2] = 2.0**-130
    return x.to(device), s.to(device)


def test_supports_takes_cuda_tiles_only():
    x, s = _inputs((256, 64), torch.bfloat16)
    assert not fold_maxima.supports(x, s)  # CPU: the quantizer's own reduction
    with pytest.raises(ValueError, match="fold_column_amax takes CUDA x"):
        fold_maxima.fold_column_amax(x, s)


@pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES[:2], ids=str)
def test_kernel_equals_the_reference_in_the_interpreter(shape, dtype):
    kernels = pytest.importorskip("minifloat.kernels.fold_maxima_triton")
    x, s = _inputs(shape, dtype)
    got = kernels.fold_column_amax_2d(x, s)
    want = _reference(x, s)
    assert got.shape == want.shape == (1, shape[1])
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    x[100, 10] = 1e4  # a new maximum in one column: the old maxima no longer match
    assert not torch.equal(kernels.fold_column_amax_2d(x, s), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_op_equals_the_reference_eager_and_compiled(shape, dtype):
    x, s = _inputs(shape, dtype, "cuda")
    assert fold_maxima.supports(x, s)
    want = _reference(x.cpu(), s.cpu())
    eager = fold_maxima.fold_column_amax(x, s)
    compiled = torch.compile(fold_maxima.fold_column_amax, fullgraph=True)(x, s)
    for got in (eager, compiled):  # a NaN's payload is the GPU's own (operand.abs_amax)
        assert bits_equal(got.cpu(), want) and got[0, 2].isnan()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
def test_compiled_transposed_quantizer_launches_the_kernel_and_equals_the_cpu(fmt):
    from torch._inductor.utils import run_and_get_code

    x, s = _inputs((1024, 384), torch.bfloat16, "cuda")

    def quantize(x, s):
        return operand.quantize_operand(x, fmt, "row", prescale=s, transpose=True)

    (values, scale), code = run_and_get_code(torch.compile(quantize, fullgraph=True), x, s)
    assert "_fold_maxima_kernel" in "\n".join(code)
    want_values, want_scale = quantize(x.cpu(), s.cpu())
    assert bits_equal(scale.cpu(), want_scale)  # inf in column 3: a NaN group
    assert bits_equal(values.float().cpu(), want_values.float())
    eager_values, eager_scale = quantize(x, s)
    assert bits_equal(eager_scale, scale) and bits_equal(eager_values.float(), values.float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", [(200, 64), (256, 100)], ids=str)
def test_shapes_off_the_tiles_keep_the_quantizers_reduction(shape):
    x, s = _inputs(shape, torch.bfloat16, "cuda")
    assert not fold_maxima.supports(x, s)
    assert not fold_maxima.supports(x[:256], s[:1])  # s not one a row
    got = operand.quantize_operand(x, "e4m3", "row", prescale=s, transpose=True)[1]
    want = operand.quantize_operand(x.cpu(), "e4m3", "row", prescale=s.cpu(), transpose=True)[1]
    assert bits_equal(got.cpu(), want)
