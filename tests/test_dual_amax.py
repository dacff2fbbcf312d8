"""kernels/dual_amax.py: a tensor's row and column maxima from one read equal the two
quantizers' own (`operand.row_amax`, `operand._column_amax`) bit for bit, NaN and ±inf included
(the Triton kernel in Triton's interpreter where it is installed, and on a GPU); a quantizer
given those maxima makes the same operand as one that computes them; and fp8-rowwise's
backward is the recipe that hands dy's maxima over (`linear._dy_maxima`)."""

from __future__ import annotations

import os

import pytest
import torch

from minifloat import recipes
from minifloat.kernels import EmulatedBackend
from minifloat.kernels.dual_amax import row_and_column_amax
from minifloat.kernels.operand import _column_amax, quantize_operand, row_amax
from minifloat.linear import _dy_maxima

SHAPES = [(1, 7), (5, 1), (130, 260), (300, 520), (512, 1024)]


def _grad_like(shape, adversarial: bool, device="cpu") -> torch.Tensor:
    r, c = shape
    v = torch.randn(shape, device=device, generator=torch.Generator(device).manual_seed(r + c))
    v = v * 1e-3
    if adversarial and r > 3 and c > 3:
        v[1], v[:, 2] = 0.0, 0.0
        v[3, 0], v[0, 3], v[r - 1, c - 1] = float("inf"), float("-inf"), float("nan")
        v[r // 2, c // 3] = -3.0e38
    return v.to(torch.bfloat16)


def _same_bits(got, want) -> bool:
    return all(
        a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))
        for a, b in zip(got, want, strict=True)
    )


@pytest.mark.parametrize("adversarial", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_cpu_maxima_are_the_quantizers_own(shape, adversarial):
    v = _grad_like(shape, adversarial)
    got = row_and_column_amax(v)
    assert got[0].shape == (shape[0], 1) and got[1].shape == (1, shape[1])
    assert _same_bits(got, (row_amax(v), _column_amax(v)))
    if adversarial and min(shape) > 3:
        assert got[0][-1].isnan() and got[1][0, -1].isnan()  # NaN's row and column
        assert got[0][3] == float("inf") and got[1][0, 3] == float("inf")


def test_rejects_non_2d():
    with pytest.raises(ValueError, match="2-D"):
        row_and_column_amax(torch.zeros(2, 3, 4))


@pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("tile", [(128, 64, 4), (16, 32, 4)])
@pytest.mark.parametrize("shape", [(130, 260), (300, 97)])
def test_triton_partials_in_the_interpreter(shape, tile):
    triton_module = pytest.importorskip("minifloat.kernels.dual_amax_triton")
    from minifloat.kernels.dual_amax import _finish

    for adversarial in (False, True):
        v = _grad_like(shape, adversarial)
        rowp, colp = triton_module.row_column_partials(v, tile)
        got = (_finish(rowp).reshape(-1, 1), _finish(colp))
        assert _same_bits(got, (row_amax(v), _column_amax(v)))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale_format", ["inv", "fp32", "pow2"])
def test_given_maxima_make_the_same_operands(fmt, scale_format):
    v = _grad_like((130, 260), adversarial=False)
    rows, cols = row_and_column_amax(v)
    for transpose, amax in ((False, rows), (True, cols)):
        kw = {"transpose": transpose, "scale_format": scale_format}
        want = quantize_operand(v, fmt, "row", **kw)
        got = quantize_operand(v, fmt, "row", amax=amax, **kw)
        assert _same_bits(
            [got[0].contiguous().view(torch.uint8).int(), got[1]],
            [want[0].contiguous().view(torch.uint8).int(), want[1]],
        )


def test_given_maxima_are_checked():
    v = _grad_like((8, 16), adversarial=False)
    rows, cols = row_and_column_amax(v)
    with pytest.raises(ValueError, match=r"float32 \(1, 16\)"):
        quantize_operand(v, "e4m3", "row", transpose=True, amax=rows)
    with pytest.raises(ValueError, match="'row' groups"):
        quantize_operand(v, "e4m3", "tensor", amax=rows)
    with pytest.raises(ValueError, match="no prescale"):
        quantize_operand(v, "e4m3", "row", amax=rows, prescale=torch.ones(1, 16))
    spec = recipes.get("nvfp4").fprop.lhs  # micro-blocks: no absmax row groups
    with pytest.raises(ValueError, match="row-scaled absmax operand"):
        EmulatedBackend().quantize(v.float(), spec, amax=rows)


@pytest.mark.parametrize("name", [n for n in recipes.names() if recipes.get(n).quantized])
def test_only_recipes_quantizing_dy_by_rows_both_ways_share_maxima(name):
    dy = _grad_like((64, 32), adversarial=False)
    r = recipes.get(name)
    rows, cols = _dy_maxima(r, dy, both_gemms=True)
    shares = name == "fp8-rowwise"  # the only built-in recipe with plain row-scaled dy twice
    assert (rows is not None) == shares and (cols is not None) == shares
    assert _dy_maxima(r, dy, both_gemms=False) == (None, None)
    if shares:
        assert _same_bits((rows, cols), (row_amax(dy), _column_amax(dy)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(130, 260), (2048, 5632), (4096, 768)])
def test_gpu_maxima_eager_and_compiled(shape):
    for adversarial in (False, True):
        v = _grad_like(shape, adversarial, device="cuda")
        want = (row_amax(v), _column_amax(v))
        assert _same_bits(row_and_column_amax(v), want)
        compiled = torch.compile(row_and_column_amax, fullgraph=True)
        assert _same_bits(compiled(v), want)
