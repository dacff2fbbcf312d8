"""kernels/weight_tensor.py: a weight's tensor-scaled E4M3 operand and its transpose in one op.

Values, transposed values, scale and "inv" multiplier equal kernels/operand.py's (the
definition) bit for bit: on the CPU through the op's own fallback, on the GPU through the two
Triton kernels, eagerly and compiled, over weights with all-zero, subnormal, huge, inf and NaN
blocks (test_weight_blocks.py's). The Hopper backend's `quantize_with_transpose` equals the
emulation's `quantize` and `transpose`.
"""

import pytest
import torch

from bits import bits_equal
from interpreter import interpreted
from minifloat import recipes
from minifloat.kernels import weight_tensor as wt
from minifloat.kernels.emulated import EmulatedBackend
from minifloat.kernels.operand import quantize_operand
from test_weight_blocks import (
    CUDA_FP8,
    GPU_SHAPES,
    SHAPES,
    _weight,
    exact_weight,
    needs_gpu,
    poisoned_call,
    weight_cases,
)
from test_weight_blocks import _check as check_operands


def _want(w: torch.Tensor, inv: bool) -> tuple[torch.Tensor, ...]:
    fmt = "inv" if inv else "fp32"
    values, scale, m = quantize_operand(
        w.cpu(), "e4m3", "tensor", scale_format=fmt, with_multiplier=True
    )
    return values, values.t().contiguous(), scale, scale if m is None else m


def _check(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    check_operands(got, want, ("values", "transposed values", "scale", "multiplier"))


def _inputs(shape: tuple[int, int], dtype: torch.dtype, device: str, specials: bool):
    """A weight with one block of each special kind, or a plain Gaussian one (one tensor scale:
    a special block sets it for the whole weight, so plain weights test ordinary scales)."""
    if specials:
        return _weight(*shape, dtype, device, seed=shape[0])
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(*shape, generator=gen) * 0.02).to(dtype).to(device)


@weight_cases(SHAPES)
def test_op_equals_operand_quantizer_on_cpu(shape, dtype, inv, specials):
    w = _inputs(shape, dtype, "cpu", specials)
    _check(wt.weight_tensor(w, inv=inv), _want(w, inv))


def test_supports_only_e4m3_tensor_scales_of_cuda_weights():
    cpu = torch.ones(256, 256)
    assert not wt.supports(cpu, "e4m3", "tensor", "inv", "nearest")  # CPU: the backends' own
    if not CUDA_FP8:
        return
    w = cpu.cuda()
    assert wt.supports(w, "e4m3", "tensor", "inv", "nearest")
    assert wt.supports(w, "e4m3", "tensor", "fp32", "nearest")
    assert not wt.supports(w, "e4m3", "row", "inv", "nearest")
    assert not wt.supports(w, "e5m2", "tensor", "inv", "nearest")
    assert not wt.supports(w, "e4m3", "tensor", "pow2", "nearest")
    assert not wt.supports(w, "e4m3", "tensor", "inv", "stochastic")
    assert not wt.supports(w[:, :200], "e4m3", "tensor", "inv", "nearest")


@weight_cases(GPU_SHAPES, gpu=True)
def test_triton_kernels_equal_operand_quantizer(shape, dtype, inv, specials, compiled):
    w = _inputs(shape, dtype, "cuda", specials)
    want = _want(w, inv)
    _check(poisoned_call(lambda t: wt.weight_tensor(t, inv=inv), w, want, compiled), want)


@interpreted
@pytest.mark.parametrize("inv", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_kernels_in_the_interpreter(shape, inv):
    """Both kernels' layouts, the maxima of every block reduced to the tensor's (56, in the last
    block only) and its scale and multiplier (8) on the CPU; the GPU test above checks the
    rounding too."""
    kernels = pytest.importorskip("minifloat.kernels.weight_tensor_triton")
    w = exact_weight(*shape, block_exponents=False)
    _check(kernels.weight_tensor_2d(w, 448.0, inv), _want(w, inv))


@pytest.mark.parametrize("name", ["fp8-tensorwise", "fp8-tensorwise:scale_format=fp32"])
@pytest.mark.gpu
@needs_gpu
def test_hopper_quantize_with_transpose_uses_the_kernels(name):
    from minifloat.kernels.hopper import HopperBackend

    spec = recipes.get(name).fprop.rhs
    w = _inputs((256, 384), torch.float32, "cuda", False)
    q, q_t = HopperBackend().quantize_with_transpose(w, spec)
    assert q_t.data.is_contiguous() and not q_t.transposed  # written, not a view
    want = EmulatedBackend().quantize(w.cpu(), spec)
    assert bits_equal(q.dequantize().cpu(), want.dequantize())
    assert bits_equal(q_t.dequantize().cpu(), want.dequantize().t())
    if spec.scale_format == "inv":  # DGE's m, as the operand quantizer gives it
        m = _want(w, True)[3]
        assert bits_equal(q.multiplier.cpu(), m)
    else:
        assert q.multiplier is None
