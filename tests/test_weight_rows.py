"""kernels/weight_rows.py: a weight's row-scaled E4M3 operands for fprop (w) and dgrad (wᵀ) in
one op.

Values, scales and "inv" multipliers equal the Emulated backend's `quantize` of w and of wᵀ
(kernels/operand.py, the definition) bit for bit: on the CPU through the op's own fallback, on
the GPU through the two Triton kernels, eagerly and compiled, over weights with all-zero,
subnormal, huge, inf and NaN blocks (test_weight_blocks.py's).
"""

import pytest
import torch

from bits import bits_equal, same_e4m3
from interpreter import interpreted
from minifloat import recipes
from minifloat.kernels import weight_rows as wr
from minifloat.kernels.emulated import EmulatedBackend
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

NAMES = ("values", "values of wᵀ", "scale", "multiplier", "scale of wᵀ", "multiplier of wᵀ")


def _want(w: torch.Tensor, inv: bool) -> tuple[torch.Tensor, ...]:
    """The backend's operands of w (fprop) and wᵀ (dgrad), the multipliers of fp32 scales the
    scales again (as the op returns them)."""
    name = "fp8-rowwise" if inv else "fp8-rowwise:scale_format=fp32"
    spec = recipes.get(name).fprop.rhs
    backend = EmulatedBackend()
    out = []
    for transpose in (False, True):
        q = backend.quantize(w.cpu(), spec, transpose=transpose)
        m = q.scale if q.multiplier is None else q.multiplier
        out += [q.data.contiguous(), q.scale, m]
    values, scale, m, values_t, scale_t, m_t = out
    return values, values_t, scale, m, scale_t, m_t


def _check(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for name, g, w in zip(NAMES, got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert g.is_contiguous(), name
        same = same_e4m3 if g.dtype == torch.float8_e4m3fn else bits_equal
        assert same(g.cpu(), w), name


def _inputs(shape: tuple[int, int], dtype: torch.dtype, device: str, specials: bool):
    if specials:
        return _weight(*shape, dtype, device, seed=shape[0])
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(*shape, generator=gen) * 0.02
    w *= torch.rand(shape[0], 1, generator=gen) * 4  # rows and columns of unlike magnitudes
    w *= torch.rand(1, shape[1], generator=gen) * 4
    return w.to(dtype).to(device)


@weight_cases(SHAPES)
def test_op_equals_the_backends_quantize_on_cpu(shape, dtype, inv, specials):
    w = _inputs(shape, dtype, "cpu", specials)
    _check(wr.weight_rows(w, inv=inv), _want(w, inv))


def test_op_compiles_on_cpu_with_its_fake_shapes():
    w = _inputs((256, 384), torch.float32, "cpu", False)
    got = torch.compile(lambda t: wr.weight_rows(t, inv=True), fullgraph=True)(w)
    _check(got, _want(w, True))


@pytest.mark.parametrize("shape", [(100, 128), (128,), (0, 128)])
def test_op_rejects_shapes_off_the_blocks(shape):
    with pytest.raises(ValueError, match="weight_rows takes .* multiples of 128"):
        wr.weight_rows(torch.ones(shape), inv=True)


def test_supports_only_fp8_rowwise_weights_on_cuda():
    rowwise = recipes.get("fp8-rowwise")
    fprop, dgrad = rowwise.fprop.rhs, rowwise.dgrad.rhs
    assert not wr.supports(torch.ones(256, 256), fprop, dgrad)  # CPU: the backends' own path
    if not CUDA_FP8:
        return
    w = torch.ones(256, 256, device="cuda")
    assert wr.supports(w, fprop, dgrad)
    fp32 = recipes.get("fp8-rowwise:scale_format=fp32")
    assert wr.supports(w, fp32.fprop.rhs, fp32.dgrad.rhs)
    assert not wr.supports(w, fprop, fp32.dgrad.rhs)  # unlike scale formats
    for other in ("fp8-tensorwise", "fp8-blockwise", "fp4"):  # reused or other operands
        assert not wr.supports(w, recipes.get(other).fprop.rhs, recipes.get(other).dgrad.rhs)
    assert not wr.supports(w[:, :200], fprop, dgrad)


@weight_cases(GPU_SHAPES, gpu=True)
def test_triton_kernels_equal_the_backends_quantize(shape, dtype, inv, specials, compiled):
    w = _inputs(shape, dtype, "cuda", specials)
    want = _want(w, inv)
    _check(poisoned_call(lambda t: wr.weight_rows(t, inv=inv), w, want, compiled), want)


def test_emulated_backend_makes_no_pair():
    rowwise = recipes.get("fp8-rowwise")
    w = _inputs((256, 384), torch.float32, "cpu", False)
    assert EmulatedBackend().quantize_weight_pair(w, rowwise.fprop.rhs, rowwise.dgrad.rhs) is None


@pytest.mark.parametrize("name", ["fp8-rowwise", "fp8-rowwise:scale_format=fp32"])
@pytest.mark.gpu
@needs_gpu
def test_hopper_quantize_weight_pair_uses_the_kernels(name):
    from minifloat.kernels.hopper import HopperBackend

    recipe = recipes.get(name)
    w = _inputs((256, 384), torch.float32, "cuda", False)
    q, q_t = HopperBackend().quantize_weight_pair(w, recipe.fprop.rhs, recipe.dgrad.rhs)
    assert q_t.data.is_contiguous() and not q_t.transposed  # written, not a view
    emulated = EmulatedBackend()
    want = emulated.quantize(w.cpu(), recipe.fprop.rhs)
    want_t = emulated.quantize(w.cpu(), recipe.dgrad.rhs, transpose=True)
    for got, ref in ((q, want), (q_t, want_t)):
        assert bits_equal(got.dequantize().cpu(), ref.dequantize())
        assert bits_equal(got.scale.cpu(), ref.scale)
        assert (got.multiplier is None) == (ref.multiplier is None)
        if ref.multiplier is not None:
            assert bits_equal(got.multiplier.cpu(), ref.multiplier)
    other = recipes.get("fp8-tensorwise")
    assert HopperBackend().quantize_weight_pair(w, other.fprop.rhs, other.dgrad.rhs) is None


@interpreted
@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (384, 128)])
def test_triton_kernels_layouts_in_the_interpreter(shape):
    """The kernels' layouts, scales and multipliers (transposed stores through wᵀ's addresses)
    on the CPU, in Triton's interpreter; the GPU test above checks the rounding too."""
    kernels = pytest.importorskip("minifloat.kernels.weight_rows_triton")
    w = exact_weight(*shape)
    got = kernels.weight_rows_2d(w, 448.0, True)
    for g, r, name in zip(got, wr._reference(w, True), NAMES, strict=True):
        assert g.shape == r.shape and g.dtype == r.dtype and g.is_contiguous(), name
        assert torch.equal(g.float(), r.float()), name
