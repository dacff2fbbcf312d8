"""kernels/weight_blocks.py: a weight's 128x128-block E4M3 operand and its transpose in one op.

The op's values and scales equal kernels/operand.py's (the definition) bit for bit: on the CPU
through the op's own fallback, on the GPU through the Triton kernel, eagerly and compiled, over
block contents that reach every branch of the scale (all-zero, subnormal, huge, inf and NaN
blocks). A backend's `quantize_with_transpose` equals its `quantize` and `transpose`.
"""

import pytest
import torch

from bits import bits_equal, same_e4m3
from interpreter import interpreted
from minifloat import recipes
from minifloat.kernels import weight_blocks as wb
from minifloat.kernels import weight_tensor as wt
from minifloat.kernels.emulated import EmulatedBackend
from minifloat.kernels.operand import quantize_operand

CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
needs_gpu = pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 tensor cores")
SHAPES = [(128, 128), (256, 384), (384, 256)]
GPU_SHAPES = SHAPES + [(2048, 2048), (5632, 2048), (2048, 5632)]


def _weight(rows: int, cols: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    """Gaussian blocks, and one block of each kind the scale treats apart (where they fit)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * 0.02
    specials = [
        lambda b: b.zero_(),  # all zero: scale 1
        lambda b: b.mul_(1e-42),  # subnormal maxima: the multiplier's floor
        lambda b: b.mul_(3e36),  # huge
        lambda b: b.__setitem__((5, 7), float("inf")),  # NaN scale and values
        lambda b: b.__setitem__((0, 0), float("nan")),
        lambda b: b.__setitem__((9, 1), -448.0 * 2**-140),  # one subnormal entry, rest normal
    ]
    blocks = [(r, c) for r in range(rows // 128) for c in range(cols // 128)]
    for make, (r, c) in zip(specials, blocks[1:], strict=False):
        make(w[r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128])
    return w.to(dtype).to(device)


def exact_weight(rows: int, cols: int, block_exponents: bool = True) -> torch.Tensor:
    """E4M3 grid values of magnitude >= 1 with ±448 on every 128th diagonal (in every row,
    column and 128 x 128 block), each block times a power of two of its own (`block_exponents`),
    or the whole weight times 2^-4 and its last block 2^-3 (the tensor's maximum, 56, in that
    block alone): every multiplier is a power of two and every scaled value on the grid, so the
    kernels' layouts, maxima and scales are checked without the interpreter's own FP8
    rounding, which is not the GPU's."""
    gen = torch.Generator().manual_seed(rows + cols)
    v = torch.randn(rows, cols, generator=gen) * 50
    w = (v.sign() * v.abs().clamp(min=1.0)).to(torch.float8_e4m3fn).float()
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    diagonal = (r - c) % 128 == 0
    w[diagonal] = torch.where((r[diagonal] % 2) == 0, 448.0, -448.0)
    if block_exponents:
        return w * torch.exp2(-(((r // 128) + 2 * (c // 128)) % 5).float())
    last = (r >= rows - 128) & (c >= cols - 128)
    return w * torch.where(last, 2.0**-3, 2.0**-4)


def _want(w: torch.Tensor, inv: bool) -> tuple[torch.Tensor, ...]:
    fmt = "inv" if inv else "fp32"
    values, scale = quantize_operand(w.cpu(), "e4m3", (128, 128), scale_format=fmt)
    return values, values.t().contiguous(), scale, scale.t().contiguous()


def _check(
    got: tuple[torch.Tensor, ...],
    want: tuple[torch.Tensor, ...],
    names: tuple[str, ...] = ("values", "transposed values", "scales", "transposed scales"),
) -> None:
    for name, g, w in zip(names, got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert g.is_contiguous(), name
        same = same_e4m3 if g.dtype == torch.float8_e4m3fn else bits_equal
        assert same(g.cpu(), w), name


@pytest.mark.parametrize("inv", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_op_equals_operand_quantizer_on_cpu(shape, dtype, inv):
    w = _weight(*shape, dtype, "cpu")
    _check(wb.weight_blocks(w, inv=inv), _want(w, inv))


@pytest.mark.parametrize("op", ["weight_blocks", "weight_tensor"])
def test_op_compiles_on_cpu_with_its_fake_shapes(op):
    # both weight ops (kernels/weight_tensor.py shares this module's checks and fake outputs)
    fn = wb.weight_blocks if op == "weight_blocks" else wt.weight_tensor
    w = _weight(256, 384, torch.float32, "cpu")
    got = torch.compile(lambda t: fn(t, inv=True), fullgraph=True)(w)
    for g, want in zip(got, fn(w, inv=True), strict=True):
        assert g.shape == want.shape and g.dtype == want.dtype
        assert torch.equal(g.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("op", ["weight_blocks", "weight_tensor"])
@pytest.mark.parametrize("shape", [(100, 128), (128, 100), (128,), (0, 128)])
def test_op_rejects_shapes_off_the_blocks(op, shape):
    fn = wb.weight_blocks if op == "weight_blocks" else wt.weight_tensor
    with pytest.raises(ValueError, match=f"{op} takes .* multiples of 128"):
        fn(torch.ones(shape), inv=True)


def test_supports_only_e4m3_128_blocks_of_cuda_weights():
    block = (128, 128)
    cpu = torch.ones(256, 256)
    assert not wb.supports(cpu, "e4m3", block, "inv", "nearest")  # CPU: the backends' own path
    if not CUDA_FP8:
        return
    w = cpu.cuda()
    assert wb.supports(w, "e4m3", block, "inv", "nearest")
    assert wb.supports(w, "e4m3", block, "fp32", "nearest")
    assert not wb.supports(w, "e4m3", (1, 128), "inv", "nearest")
    assert not wb.supports(w, "e5m2", block, "inv", "nearest")
    assert not wb.supports(w, "e4m3", block, "pow2", "nearest")
    assert not wb.supports(w, "e4m3", block, "inv", "stochastic")
    assert not wb.supports(w[:, :200], "e4m3", block, "inv", "nearest")


@pytest.mark.parametrize(
    "name", ["fp8-blockwise", "fp8-blockwise:scale_format=fp32", "fp8-tensorwise"]
)
def test_emulated_quantize_with_transpose_is_quantize_then_transpose(name):
    spec = recipes.get(name).fprop.rhs
    backend = EmulatedBackend()
    w = _weight(256, 384, torch.float32, "cpu")
    q, q_t = backend.quantize_with_transpose(w, spec)
    want = backend.quantize(w, spec)
    want_t = backend.transpose(want)
    assert bits_equal(q.dequantize(), want.dequantize())
    assert bits_equal(q_t.dequantize(), want_t.dequantize())
    assert bits_equal(q_t.dequantize(), q.dequantize().t())


@pytest.mark.parametrize("inv", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.gpu
@needs_gpu
def test_triton_kernel_equals_operand_quantizer(shape, dtype, inv, compiled):
    w = _weight(*shape, dtype, "cuda", seed=len(shape) + shape[0])
    want = _want(w, inv)
    _check(poisoned_call(lambda t: wb.weight_blocks(t, inv=inv), w, want, compiled), want)


@interpreted
@pytest.mark.parametrize("inv", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_kernel_in_the_interpreter(shape, inv):
    """The kernel's layouts and both scale layouts (each block's scale its own) on the CPU; the
    GPU test above checks the rounding too."""
    kernel = pytest.importorskip("minifloat.kernels.weight_blocks_triton")
    w = exact_weight(*shape)
    _check(kernel.weight_blocks_2d(w, 448.0, inv), _want(w, inv))


def weight_cases(shapes: list[tuple[int, int]], *, gpu: bool = False):
    """The weight ops' kernel tests' cases (kernels/weight_tensor.py's and weight_rows.py's):
    `shapes` x float32 and bf16 weights x "inv" and fp32 scales x plain weights and ones with
    special blocks; on the GPU also eager and compiled."""
    marks = [
        pytest.mark.parametrize("shape", shapes),
        pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16]),
        pytest.mark.parametrize("inv", [True, False]),
        pytest.mark.parametrize("specials", [False, True]),
    ]
    if gpu:
        marks += [pytest.mark.parametrize("compiled", [False, True]), needs_gpu, pytest.mark.gpu]

    def mark(test):
        for m in marks:
            test = m(test)
        return test

    return mark


def poisoned_call(fn, w: torch.Tensor, want: tuple[torch.Tensor, ...], compiled: bool):
    """fn(w), compiled first if asked, after blocks of `want`'s sizes were filled with 0x55 and
    freed: the caching allocator hands them out again, so bytes the kernel fails to write cannot
    pass as a previous call's right ones (Triton 3.6's `tl.trans` of cast fp8 tiles wrote wrong
    bytes)."""
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    junk = [torch.full((t.numel() * t.element_size(),), 0x55, dtype=torch.uint8, device="cuda")
            for t in want]  # fmt: skip
    del junk
    return fn(w)


@pytest.mark.parametrize("name", ["fp8-blockwise", "fp8-blockwise:scale_format=fp32"])
@pytest.mark.gpu
@needs_gpu
def test_hopper_quantize_with_transpose_uses_the_kernel(name):
    from minifloat.kernels.hopper import HopperBackend

    spec = recipes.get(name).fprop.rhs
    w = _weight(256, 384, torch.float32, "cuda")
    q, q_t = HopperBackend().quantize_with_transpose(w, spec)
    assert q_t.data.is_contiguous() and not q_t.transposed  # written, not a view
    want = EmulatedBackend().quantize(w.cpu(), spec)
    assert bits_equal(q.dequantize().cpu(), want.dequantize())
    assert bits_equal(q_t.dequantize().cpu(), want.dequantize().t())
