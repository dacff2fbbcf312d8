"""kernels/transpose.py: the opaque transposed copy equals `x.t().contiguous()` and the opaque
unpack-and-transpose of packed E2M1 codes equals `unpack_e2m1(...).t()`, bit for bit (CPU,
compiled, and the Triton kernels on a GPU); `QOperand.transposed`, which tells the Hopper
backend which GEMM operands to copy, is true exactly for the transposed views; and what a
compiled block saves for backward (no extra operands, nothing quantized under fp4, no padding
buffer of a padded GEMM operand); `scaled_mm.pad_contraction`'s zero bytes."""

from __future__ import annotations

import math

import pytest
import torch

from interpreter import interpreted
from minifloat import recipes
from minifloat.convert import convert
from minifloat.kernels import EmulatedBackend
from minifloat.kernels.backend import QOperand
from minifloat.kernels.operand import pack_e2m1, round_to_storage, unpack_e2m1
from minifloat.kernels.scaled_mm import pad_contraction
from minifloat.kernels.transpose import transpose_copy, unpack_e2m1_t
from minifloat.linear import QuantLinear, QuantLinearFunction
from scripts import load_benchmark

# benchmarks/partition_probe.py: the one-block LLaMA and its saved tensors, shared with the tests
_PROBE = load_benchmark("partition_probe")

DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float32, torch.uint8]
SHAPES = [(1, 7), (5, 1), (33, 17), (130, 260)]
QUANT_RECIPES = [n for n in recipes.names() if recipes.get(n).quantized] + [
    "fp4:occ.compensation_format=fp32",
    "fp4-occ:scaling.input=tensor",
    "fp8-blockwise:occ=on",
]


def _data(shape, dtype, device="cpu") -> torch.Tensor:
    x = torch.randn(shape, device=device) * 8
    return x.to(torch.uint8) if dtype == torch.uint8 else x.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_transpose_copy_is_a_contiguous_transposed_copy(shape, dtype):
    x = _data(shape, dtype)
    out = transpose_copy(x)
    assert out.is_contiguous() and out.shape == (shape[1], shape[0]) and out.dtype == dtype
    assert torch.equal(_bits(out), _bits(x.t().contiguous()))
    assert out.data_ptr() != x.data_ptr()  # a copy, never an alias (custom-op contract)
    assert torch.equal(_bits(transpose_copy(x[:, ::2])), _bits(x[:, ::2].t().contiguous()))


def test_transpose_copy_passes_opcheck_and_compiles_as_one_node():
    x = _data((12, 20), torch.float8_e4m3fn)
    torch.library.opcheck(torch.ops.minifloat.transpose_copy.default, (x.float(),))
    fn = torch.compile(lambda t: transpose_copy(t * 2), fullgraph=True)
    assert torch.equal(fn(x.float()), (x.float() * 2).t().contiguous())


def test_transpose_copy_rejects_other_ranks():
    with pytest.raises(ValueError, match="2-D"):
        transpose_copy(torch.zeros(2, 3, 4))


def _packed(rows: int, cols: int, device: str = "cpu") -> torch.Tensor:
    """E2M1 codes of random grid values (both zeros, NaN, ±6 included), packed two a byte."""
    v = round_to_storage(torch.randn(rows, cols, device=device) * 3, "e2m1").float()
    v.view(-1)[:4] = torch.tensor([-0.0, 6.0, -6.0, float("nan")])[: v.numel()]
    return pack_e2m1(v)


@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (5, 7), (33, 64), (130, 257)], ids=str)
def test_unpack_e2m1_t_is_the_transposed_unpack(shape):
    rows, cols = shape
    packed = _packed(rows, cols)
    out = unpack_e2m1_t(packed, cols)
    want = unpack_e2m1(packed, cols).t().contiguous()
    assert out.is_contiguous() and out.dtype == torch.float8_e4m3fn and out.shape == (cols, rows)
    assert torch.equal(_bits(out), _bits(want))


def test_unpack_e2m1_t_passes_opcheck_and_rejects_bad_input():
    packed = _packed(6, 9)
    torch.library.opcheck(torch.ops.minifloat.unpack_e2m1_t.default, (packed, 9))
    with pytest.raises(ValueError, match="uint8"):
        unpack_e2m1_t(packed.float(), 9)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_e2m1_t(packed, 11)


class _LayoutCheckingBackend(EmulatedBackend):
    """The reference backend, asserting at every GEMM that each operand's `transposed` flag says
    whether its data is a transposed view of a contiguous tensor."""

    def __init__(self) -> None:
        self.checked = 0

    def scaled_mm(self, a: QOperand, b: QOperand, **kwargs) -> torch.Tensor:
        for q in (a, b):
            if q.data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                base = q.data.t() if q.transposed else q.data
                assert base.is_contiguous() and (q.transposed != q.data.is_contiguous())
                self.checked += 1
        return super().scaled_mm(a, b, **kwargs)


@pytest.mark.parametrize("name", QUANT_RECIPES)
def test_operand_transposed_flag_matches_the_layout(name):
    torch.manual_seed(0)
    layer = QuantLinear(64, 48, recipe=name)
    x = torch.randn(32, 64, requires_grad=True)
    backend = _LayoutCheckingBackend()
    y = QuantLinearFunction.apply(
        x, layer.weight, layer.bias, layer.recipe, backend, torch.float32,
        layer.amax_history, layer.rng_state,
    )  # fmt: skip
    y.backward(torch.randn_like(y))
    if not name.startswith(("nvfp4", "mxfp4")):  # micro-block GEMMs take the bf16 path
        assert backend.checked >= 6  # both operands of fprop, dgrad and wgrad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES + [(1000, 3000), (16384, 96)], ids=str)
def test_triton_transpose_equals_aten(shape, dtype):
    from minifloat.kernels.transpose_triton import transpose_2d

    x = _data(shape, dtype, "cuda")
    want = _bits(x.t().contiguous())
    assert torch.equal(_bits(transpose_copy(x)), want)
    for tile in ((64, 64, 4), (128, 128, 8)):
        assert torch.equal(_bits(transpose_2d(x, tile)), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES + [(1000, 3000)], ids=str)
def test_compiled_transpose_launches_the_triton_kernel_from_generated_code(shape, dtype):
    """Under torch.compile on CUDA the transpose is the `triton_op`: the same bytes, and the
    tiled kernel launched from inductor's code, not the Library op through Python."""
    from torch._inductor.utils import run_and_get_code

    x = _data(shape, dtype, "cuda")
    torch._dynamo.reset()
    if dtype in (torch.bfloat16, torch.float32):
        torch.library.opcheck(torch.ops.minifloat.transpose_copy_traced.default, (x,))
    out, code = run_and_get_code(torch.compile(transpose_copy, fullgraph=True), x)
    assert torch.equal(_bits(out), _bits(x.t().contiguous()))
    code = "\n".join(code)
    assert "_transpose_kernel" in code and "minifloat.transpose_copy.default" not in code


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tile", [None, (32, 64, 4)], ids=str)
def test_triton_kernels_in_the_interpreter(dtype, tile):
    """Both kernels on the CPU in Triton's interpreter, ragged edges included: they move bits
    (the unpack maps codes to bytes), so the interpreter's bytes are the GPU's."""
    kernels = pytest.importorskip("minifloat.kernels.transpose_triton")
    for shape in SHAPES:
        x = _data(shape, dtype)
        got = kernels.transpose_2d(x, tile)
        assert got.dtype == dtype and got.is_contiguous(), shape
        assert torch.equal(_bits(got), _bits(x.t().contiguous())), shape
    for rows, cols in [(1, 1), (5, 7), (33, 64), (130, 257)]:
        packed = _packed(rows, cols)
        got = kernels.unpack_e2m1_t_2d(packed, cols, tile or (64, 64, 4))
        assert torch.equal(_bits(got), _bits(unpack_e2m1(packed, cols).t())), (rows, cols)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (130, 257), (2048, 4096), (16384, 97)], ids=str)
def test_triton_unpack_e2m1_t_equals_aten(shape):
    from minifloat.kernels.transpose_triton import unpack_e2m1_t_2d

    rows, cols = shape
    packed = _packed(rows, cols, "cuda")
    want = _bits(unpack_e2m1(packed, cols).t().contiguous())
    assert torch.equal(_bits(unpack_e2m1_t(packed, cols)), want)
    for tile in ((32, 16, 4), (128, 64, 8)):
        assert torch.equal(_bits(unpack_e2m1_t_2d(packed, cols, tile)), want)


def force_hopper_path(monkeypatch) -> None:
    """The Hopper GEMM path on the CPU: `torch._scaled_mm` runs tensor- and row-scaled FP8 there
    too (block scales excepted), so compiled models take the GPU's code path."""
    from minifloat.kernels import scaled_mm as smm
    from minifloat.kernels import select

    monkeypatch.setattr(select, "_fp8_gemm_available", lambda *args: True)
    monkeypatch.setattr(smm, "supported", _PROBE.scaled_mm_runs_on_cpu)


def _saved_bytes(recipe: str) -> int:
    """Bytes a compiled one-block LLaMA's block saves for backward (parameters left out)."""
    return sum(n for n, _ in _nbytes(_saved(recipe)))


def _nbytes(saved: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[tuple[int, torch.dtype]]:
    """(bytes, dtype) of each tensor of a `_saved` list."""
    return [(math.prod(shape) * dtype.itemsize, dtype) for dtype, shape in saved]


def _saved_dtypes(recipe: str, *, wide: bool = False) -> set[torch.dtype]:
    """Dtypes of what a compiled one-block LLaMA's block saves for backward (parameters left
    out)."""
    return {dtype for dtype, _ in _saved(recipe, wide=wide)}


def _saved(recipe: str, *, wide: bool = False) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape) of each tensor the compiled block of a one-block LLaMA (dim 256, FFN 704,
    vocab 1000; `wide`: the 1.3B model's dim 2048, FFN 5632 and 16 heads) converted to `recipe`
    saves for backward, parameters and the block's inputs left out. Read from inductor's own
    partition of the block's graph (`partition_probe.forward_saves`), which is what the compiled
    block saves when it runs; its code is not generated (the fp4 block at 1.3B width: 42 s
    against 114 s compiled and run, cold caches, 2-core CPU)."""
    net = _PROBE.one_block_llama(recipe, "1.3B" if wide else "small", compile_block=False)
    tokens = torch.randint(0, 1000, (1, 128) if wide else (2, 128))
    return _activations(_PROBE.forward_saves(net, tokens))


def _activations(saves: list[tuple[str, torch.dtype, tuple]]) -> list[tuple[torch.dtype, tuple]]:
    """`forward_saves`' entries without the parameters and inputs passed through (`primals_*`)."""
    return [(dtype, shape) for name, dtype, shape in saves if not name.startswith("primals")]


@pytest.mark.parametrize("recipe", ["fp8-tensorwise"])  # fp4-dge: same check, 165 s
def test_backward_transposes_change_no_saved_activations(recipe, monkeypatch):
    """The Hopper GEMM path (forced on the CPU: `torch._scaled_mm` runs FP8 there too) saves the
    same bytes for backward whether wgrad's dyᵀ is copied by its cast's kernel (the compiled
    `hopper._row_major` since session 60) or by the opaque transpose (before). The saved
    operands themselves stay plain copies under compile (`linear._unstash`): through the opaque
    op the partitioner saved the FP8 operands it otherwise recomputes (+5.4 GB at 1.3B,
    docs/hopper.md)."""
    from minifloat.kernels import hopper

    force_hopper_path(monkeypatch)
    fused = _saved_bytes(recipe)

    def opaque(q: QOperand) -> torch.Tensor:  # session 59's compiled form
        data = hopper._one_buffer(q.data.t() if q.transposed else q.data)
        return transpose_copy(data) if q.transposed else data

    monkeypatch.setattr(hopper, "_row_major", opaque)
    assert fused == _saved_bytes(recipe)


@pytest.mark.parametrize("recipe", ["fp4-dge"])
def test_compiled_fp4_block_saves_no_quantized_operand(recipe, monkeypatch):
    """Under torch.compile with the Hopper GEMM path (forced on the CPU), a LLaMA block under
    fp4-dge saves no quantized operand at all, as fp8-tensorwise does: the partitioner
    recomputes the E2M1 operands in backward from tensors saved anyway. When the E2M1 rounding
    took its grid spacings from `torch.where` constants (shared by every quantizer of the
    graph), the partitioner's "used above/below fusible" rule banned that recomputation and the
    block saved its E2M1 operands (packed: the transposed weights, the SwiGLU output and the
    attention and MLP inputs; docs/hopper_sessions.md, session 7).
    """
    force_hopper_path(monkeypatch)
    dtypes = _saved_dtypes(recipe)
    assert not {torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2} & dtypes, dtypes


@pytest.mark.parametrize("recipe", ["fp4-dge", "fp4"])
def test_compiled_fp4_block_of_1p3b_width_saves_no_quantized_operand(monkeypatch, recipe):
    """As above with the 1.3B model's widths (1 x 128 tokens), where the graph is the one the
    partitioner sees in training; the small block does not show this. With one more graph node
    in each of the two quantizers between the gate GEMM and the down projection's E2M1 input,
    its "long fusible chain" rule banned recomputing that input and the block saved it
    (+2 GiB at 1.3B; docs/hopper_sessions.md, sessions 22 and 23; kernels/operand.py). Under
    fp4, E2M1's saturation in `round_to_storage` written as `torch.where(|q| > 6, 6, |q|)`
    made the block save E4M3 operands of the down projection's and another input's width
    (+3.6 GiB at 1.3B; session 72), which the small block did not show either."""
    force_hopper_path(monkeypatch)
    dtypes = _saved_dtypes(recipe, wide=True)
    assert not {torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2} & dtypes, dtypes


@pytest.mark.parametrize("name", ["fp4", "fp4:occ.one_gemm=off"])
def test_compiled_fp4_occ_block_saves_no_quantized_operand(monkeypatch, name):
    """Under fp4 (OCC) too the compiled block saves no quantized operand: the partitioner
    recomputes in backward the E4M3 wgrad operands z. It saved every z (session 31; 4.3 GiB at
    1.3B) while the finite masks counted as reductions, a graph constant was shared by every
    remainder, and the quantizers read the tensor whose sample was sorted
    (partition_hints.py); and again with fprop's one GEMM while its row shifts were `prod`s,
    which the partitioner does not recompute (session 65)."""
    force_hopper_path(monkeypatch)
    dtypes = _saved_dtypes(name)
    assert not {torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2} & dtypes, dtypes


def test_compiled_fp4_occ_transformers_block_saves_no_quantized_operand(monkeypatch):
    """The same for a `transformers` LlamaForCausalLM block (its RMSNorm hands the projections
    bf16 inputs, ours float32): before partition_hints.py it saved every z too."""
    transformers = pytest.importorskip("transformers")
    force_hopper_path(monkeypatch)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=704, num_attention_heads=4, num_key_value_heads=4,
        num_hidden_layers=1, vocab_size=1000, use_cache=False,
    )  # fmt: skip
    net = convert(transformers.LlamaForCausalLM(cfg), "fp4")
    saves = _PROBE.forward_saves(net, torch.randint(0, 1000, (2, 128)), net.model.layers)
    dtypes = {dtype for dtype, _ in _activations(saves)}
    assert not {torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2} & dtypes, dtypes


def _compiled_step_code(recipe: str) -> list[str]:
    """The generated code (forward, backward) of one compiled training step of a one-block
    LLaMA under `recipe`."""
    from torch._inductor.utils import run_and_get_code

    net = _PROBE.one_block_llama(recipe, "small")
    tokens = torch.randint(0, 1000, (2, 64))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            net(tokens).float().square().mean().backward()

    torch._dynamo.reset()
    _, codes = run_and_get_code(step)
    torch._dynamo.reset()
    return codes


def _fp8_buffers(codes: list[str]) -> tuple[int, int]:
    """(forward, backward): how many FP8 tensors the generated code writes, counting a buffer
    inductor allocates or reuses for another tensor once each."""
    import re

    counts = []
    for code in codes:
        fp8 = set(re.findall(r"(buf\d+) = empty_strided_cpu\([^\n]*torch\.float8", code))
        reuses = r"(buf\d+) = (?:reinterpret_tensor\()?(buf\d+)[,;][^\n]*# reuse"
        for new, old in re.findall(reuses, code):  # in program order
            if old in fp8:
                fp8.add(new)
        counts.append(len(fp8))
    return counts[0], counts[1]


def test_gemm_inputs_are_written_once(monkeypatch):
    """Under torch.compile (Hopper GEMM path forced on the CPU) a quantized operand read by
    several GEMMs is written once: x_q of q/k/v and of gate/up in forward, their transposed
    copies for wgrad, and each dy_q that dgrad reads and wgrad transposes. Inductor copied an
    unwritten input of every `_scaled_mm` / opaque op per consumer (`hopper._one_buffer`).
    wgrad's dyᵀ is a plain copy that inductor writes from the cast's kernel, not the opaque
    transpose (`hopper._row_major`: 1.2-4.9 ms a 1.3B step faster, session 60)."""
    from minifloat.kernels import hopper

    force_hopper_path(monkeypatch)
    codes = _compiled_step_code("fp8-tensorwise")
    assert len(codes) == 2, len(codes)  # forward, backward
    fwd, bwd = _fp8_buffers(codes)
    # seven weights and four inputs (q/k/v's, wo's, gate/up's, w2's), each once
    assert fwd == 11, fwd
    assert "minifloat.transpose_copy" not in codes[1]
    # each consumer's own copy, as inductor makes it without `written_once`
    monkeypatch.setattr(hopper, "_one_buffer", lambda t: t.contiguous())
    fwd_before, bwd_before = _fp8_buffers(_compiled_step_code("fp8-tensorwise"))
    assert fwd_before > fwd and bwd_before > bwd, (fwd, bwd, fwd_before, bwd_before)


def test_compiled_blockwise_block_saves_no_quantized_operand():
    """Under torch.compile a block-scaled saved operand is written untransposed
    (`exact.written_once`) and copied transposed in plain PyTorch (`linear._unstash`; inductor
    no longer fuses that copy into the SwiGLU backward as byte stores a column apart: session
    27): the partitioner still recomputes it in backward rather than saving it. Through the
    opaque transpose instead, fp8-blockwise at 1.3B saved +1.1 GiB (docs/hopper_sessions.md).
    The emulation computes its GEMMs: `torch._scaled_mm` has no block scales on the CPU."""
    dtypes = _saved_dtypes("fp8-blockwise")
    assert not {torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2} & dtypes, dtypes


@pytest.mark.parametrize("recipe", ["fp8-blockwise", "fp8-tensorwise"])
def test_padded_gemm_operands_leave_nothing_quantized_saved(recipe, monkeypatch):
    """The Hopper path (forced on the CPU; the graph is partitioned, not run, since block-scaled
    `_scaled_mm` has no CPU kernel) saves no FP8 or byte tensor for backward, also where a
    block-scaled GEMM pads its contraction to 512 (the small block's dim 256 and FFN 704, as
    7B's FFN 11008). The padding was a `torch.zeros` buffer written into, one node that forward
    and backward shared, and the partitioner saved it: ~0.2 GiB a layer at 7B width
    (docs/hopper_sessions.md, session 29)."""
    force_hopper_path(monkeypatch)
    net = _PROBE.one_block_llama(recipe, "small", compile_block=False)
    saves = _PROBE.forward_saves(net, torch.randint(0, 1000, (2, 128)))
    quantized = [(name, dtype) for name, dtype, _ in saves
                 if dtype in (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)]  # fmt: skip
    assert quantized == []


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize(("k", "multiple"), [(704, 512), (11008, 512), (300, 16), (512, 512)])
def test_pad_contraction_appends_zero_bytes(dtype, k, multiple):
    """The operand's bytes, then zeros up to the multiple; eager and compiled alike."""
    t = torch.randn(5, k).clamp(-400, 400).to(dtype)
    for fn in (pad_contraction, torch.compile(pad_contraction)):
        out = fn(t, multiple)
        assert out.dtype == dtype and out.shape == (5, -(-k // multiple) * multiple)
        assert torch.equal(out[:, :k].view(torch.uint8), t.view(torch.uint8))
        assert not out[:, k:].view(torch.uint8).any()
