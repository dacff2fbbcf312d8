"""QuantLinear on the Hopper backend equals the emulated backend, recipe by recipe (GPU only).

Both backends run the same autograd Function (the emulation on CPU copies of the inputs: its
CPU arithmetic is plain IEEE float32); a recording subclass of each logs every quantized operand,
and the logs must agree bit for bit (values and scales). GEMM outputs agree within
HOPPER_VS_EMULATED_RTOL (tests/tolerances.py).
"""

import copy
import warnings

import pytest
import torch

from bits import bits_equal
from minifloat import recipes
from minifloat.linear import QuantLinear, QuantLinearFunction
from tolerances import HOPPER_VS_EMULATED_RTOL

CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 tensor cores"),
]

# Every quantized recipe, plus OCC with a strided threshold sample (the test inputs hold fewer
# entries than the default sample) and with the fp32 reference compensation, and power-of-two
# and fp32 scales, divided rather than the default "inv" (tensor, and row with OCC and DGE;
# fp32 also row without OCC and blocks).
QUANT_RECIPES = [n for n in recipes.names() if recipes.get(n).quantized] + [
    "fp4:occ.sample_size=1024",
    "fp4:occ.compensation_format=fp32",
    "fp4:occ.sample_size=1024:occ.one_gemm=off",
    "fp8-tensorwise:scale_format=pow2",
    "fp4:scale_format=pow2",
    "fp8-tensorwise:scale_format=fp32",
    "fp8-rowwise:scale_format=fp32",
    "fp8-blockwise:scale_format=fp32",
    "fp4:scale_format=fp32",
]


def _recording(base):
    class Recording(base):
        def __init__(self):
            super().__init__()
            self.log, self.paired = [], []

        def quantize(self, *args, **kwargs):
            q = super().quantize(*args, **kwargs)
            self.log.append(q)
            return q

        def quantize_weight_pair(self, w, fprop, dgrad):
            # fprop's operand logged in its place; dgrad's apart: the emulation quantizes it in
            # backward, the Hopper backend with fprop's (kernels/weight_rows.py)
            pair = super().quantize_weight_pair(w, fprop, dgrad)
            if pair is not None:
                self.log.append(pair[0])
                self.paired.append(pair[1])
            return pair

        def quantize_with_transpose(self, w, spec):
            # one entry, the fprop operand, whether or not the backend went through quantize
            start = len(self.log)
            q, q_t = super().quantize_with_transpose(w, spec)
            del self.log[start:]
            self.log.append(q)
            return q, q_t

    return Recording()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _run(backend, recipe, x, weight, dy, history, device):
    x = x.detach().to(device).requires_grad_(True)
    w = weight.detach().to(device).requires_grad_(True)
    hist = None if history is None else history.clone().to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = QuantLinearFunction.apply(x, w, None, recipe, backend, torch.bfloat16, hist)
    y.backward(dy.to(device))
    return y.cpu(), x.grad.cpu(), w.grad.cpu()


def _inputs(m, k, n, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    x[:, 3] *= 30  # an outlier channel for OCC
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.05
    dy = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
    return x, w, dy


@pytest.mark.parametrize("name", QUANT_RECIPES)
@pytest.mark.parametrize("m", [256, 77])
def test_hopper_equals_emulated(name, m):
    from minifloat.kernels.emulated import EmulatedBackend
    from minifloat.kernels.hopper import HopperBackend

    recipe = recipes.get(name)
    x, w, dy = _inputs(m, 256, 384)
    hist = None
    if recipe.delayed is not None:
        hist = torch.rand(3, recipe.delayed.history_len, device="cuda")
    hop, emu = _recording(HopperBackend), _recording(EmulatedBackend)
    y_h, dx_h, dw_h = _run(hop, recipe, x, w, dy, hist, "cuda")
    y_e, dx_e, dw_e = _run(emu, recipe, x, w, dy, hist, "cpu")

    for qp in hop.paired:  # each where the emulation made it, in backward
        same = [i for i, qe in enumerate(emu.log) if qe.shape == qp.shape
                and bits_equal(qp.values().cpu(), qe.values())
                and bits_equal(qp.scale.cpu(), qe.scale)]  # fmt: skip
        assert same, "dgrad's weight operand, made with fprop's, differs from the emulation's"
        del emu.log[same[0]]
    assert len(hop.log) == len(emu.log) > 0
    for i, (qh, qe) in enumerate(zip(hop.log, emu.log, strict=True)):
        assert qh.granularity == qe.granularity and qh.fmt == qe.fmt, i
        assert bits_equal(qh.values().cpu(), qe.values()), f"operand {i} values"
        assert bits_equal(qh.scale.cpu(), qe.scale), f"operand {i} scale"
    assert _rel(y_h, y_e) < HOPPER_VS_EMULATED_RTOL["y"]
    assert _rel(dx_h, dx_e) < HOPPER_VS_EMULATED_RTOL["dx"]
    assert _rel(dw_h, dw_e) < HOPPER_VS_EMULATED_RTOL["dw"]


def test_ragged_dims_fall_back_with_warning():
    from minifloat.kernels.hopper import FallbackWarning

    layer = QuantLinear(64, 40, bias=False, recipe="fp8-rowwise", backend="hopper").cuda()
    ref = QuantLinear(64, 40, bias=False, recipe="fp8-rowwise", backend="emulated").cuda()
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(33, 64, device="cuda")
    with pytest.warns(FallbackWarning):
        y = layer(x)
    assert _rel(y, ref.cpu()(x.cpu()).cuda()) < 1e-6  # fp32 GEMMs of identical operands
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        layer(x)
        layer(x)
    assert sum(issubclass(c.category, FallbackWarning) for c in caught) <= 1


def _compiled_and_eager(
    name: str, autocast: bool, bias: bool = False, options: dict | None = None, tokens: int = 96
) -> list[tuple]:
    """(y, dx, dw) of one step of a layer and of its compiled copy (`options`: inductor's)."""
    torch._dynamo.reset()
    layer = QuantLinear(256, 384, bias=bias, recipe=name, backend="auto").cuda()
    compiled = torch.compile(copy.deepcopy(layer), fullgraph=True, options=options)
    x, _, dy = _inputs(tokens, 256, 384)
    return _steps((layer, compiled), x if autocast else x.float(), dy, autocast)


def _steps(mods: tuple, x: torch.Tensor, dy: torch.Tensor, autocast: bool) -> list[tuple]:
    """(y, dx, dw) of one forward and backward of each module in `mods` on the same x and dy."""
    outs = []
    for mod in mods:
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = mod(xi)
        y.backward(dy.to(y.dtype))
        outs.append((y, xi.grad, mod.weight.grad))
    return outs


@pytest.mark.parametrize("name", QUANT_RECIPES)
def test_torch_compile_matches_eager(name):
    # fullgraph: choosing the backend or running its kernels must not break the graph (a break
    # made the trainer's compiled step recompile per input dtype and fall back to eager). Eager
    # CUDA calls run the quantizers' compiled twins, the compiled layer inlines the same PyTorch
    # functions, and the GEMMs are the same cuBLAS calls: the results must be identical.
    outs = _compiled_and_eager(name, autocast=True)
    for key, a, b in zip(("y", "dx", "dw"), outs[0], outs[1], strict=True):
        assert bits_equal(b, a), f"{name}: compiled {key} differs from eager"


# The recipes with issue 13's training targets, and fp8-delayed (state carried between steps).
TRAINING_RECIPES = ["fp8-tensorwise", "fp8-rowwise", "fp8-blockwise", "fp8-delayed", "fp4-direct",
                    "fp4-dge", "fp4"]  # fmt: skip


@pytest.mark.parametrize("name", TRAINING_RECIPES)
def test_compiled_steps_keep_one_graph_as_data_changes(name):
    """Three training steps of a compiled layer on new data each (the scale grows, the outlier
    channel moves): eager's bits every step, no graph compiled after the first step, no break
    (dynamo's counters), as tests/test_compile.py checks for the emulation on the CPU. A
    threshold or scale that leaked into a guard as a Python number would recompile on the
    second step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    layer = QuantLinear(256, 384, bias=False, recipe=name, backend="auto").cuda()
    compiled_layer = copy.deepcopy(layer)
    compiled = torch.compile(compiled_layer, fullgraph=True)
    graphs = []  # dynamo's graphs after each step: eager CUDA calls compile the quantizers' twins
    for step in range(3):
        x, _, dy = _inputs(96, 256, 384, seed=step)
        x = x * (1 + step)
        x[:, 3 + step] *= 8.0
        layer.weight.grad = compiled_layer.weight.grad = None
        outs = _steps((layer, compiled), x, dy, autocast=True)
        for key, a, b in zip(("y", "dx", "dw"), *outs, strict=True):
            assert bits_equal(b, a), f"{name} step {step}: compiled {key} differs from eager"
        graphs.append(counters["stats"]["unique_graphs"])
    # Step 0 compiles the layer's one graph and, for the eager layer, the quantizers' twins (3-10
    # graphs in all on the H200, session 100); new data must compile nothing more.
    assert graphs == [graphs[0]] * 3, (graphs, dict(counters["stats"]))
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("autocast", [True, False])
def test_fp32_compensation_compiled_matches_eager_at_long_contractions(autocast):
    """The fp32 reference compensation's dense fp32 GEMMs sum inexact products, so compiled and
    eager must make the same cuBLAS calls, through an opaque op on row-major copies
    (occ_gemm.fp32_mm): at 1024 tokens compiled code had handed cuBLAS dyᵀ transposed, and 317
    of dw's 98,304 entries were other bits (session 84, H100)."""
    name = "fp4:occ.compensation_format=fp32"
    outs = _compiled_and_eager(name, autocast=autocast, tokens=1024)
    for key, a, b in zip(("y", "dx", "dw"), outs[0], outs[1], strict=True):
        assert bits_equal(b, a), f"{name}: compiled {key} differs from eager"


@pytest.mark.parametrize("name", ["fp8-tensorwise", "fp8-rowwise", "fp4-dge", "fp4"])
def test_cpp_wrapper_matches_eager(name):
    """Inductor's C++ wrapper launches the compiled graphs' kernels from C++ (less host time a
    launch); torch 2.11 compiles it only with `triton.store_cubin` (docs/hopper_sessions.md,
    session 53). The kernels are the same, so are the bits; the Library and Triton ops (the
    opaque reciprocal and transpose, OCC's sort) must run from it too."""
    options = {"cpp_wrapper": True, "triton.store_cubin": True}
    outs = _compiled_and_eager(name, autocast=True, options=options)
    for key, a, b in zip(("y", "dx", "dw"), outs[0], outs[1], strict=True):
        assert bits_equal(b, a), f"{name}: compiled {key} differs from eager"


@pytest.mark.parametrize("name", ["fp8-tensorwise", "fp4-dge"])
@pytest.mark.parametrize("bias", [False, True])
def test_torch_compile_matches_eager_in_float32(name, bias):
    """Without autocast the layer's output is float32 all along: torch 2.11's dynamo gave the
    autograd.Function zero gradients while it returned `y.to(y.dtype)` (exact.to_dtype)."""
    outs = _compiled_and_eager(name, autocast=False, bias=bias)
    for key, a, b in zip(("y", "dx", "dw"), outs[0], outs[1], strict=True):
        assert a.dtype == torch.float32 and a.abs().max() > 0, key
        assert bits_equal(b, a), f"{name}: compiled {key} differs from eager"


@pytest.mark.parametrize("threshold", ["exact", "sampled"])
def test_occ_thresholds_and_fold_equal_the_cpu_emulation(threshold):
    """OCC's parts outside `quantize` (logged above): the thresholds (a sort on CUDA, order
    statistics on CPU) and the folded wgrad operand (its compiled twin on CUDA) are bit-equal."""
    from minifloat.kernels.hopper import HopperBackend
    from minifloat.occ import fold_remainder, thresholds
    from minifloat.recipes import OCCConfig

    cfg = OCCConfig(threshold=threshold, sample_size=4096)
    x, _, _ = _inputs(512, 256, 16)
    clip_gpu, clip_cpu = thresholds(x, cfg), thresholds(x.cpu(), cfg)
    for a, b in zip(clip_gpu, clip_cpu, strict=True):
        assert bits_equal(a.cpu(), b)
    x_q = HopperBackend().quantize(x, recipes.get("fp4").fprop.lhs, clip=clip_gpu)
    fold = HopperBackend().kernel(fold_remainder, x)
    got = fold(x, *clip_gpu, x_q.data, x_q.scale, x_q.multiplier, 6.0)
    cpu_args = (x_q.data.cpu(), x_q.scale.cpu(), x_q.multiplier.cpu())
    want = fold_remainder(x.cpu(), *clip_cpu, *cpu_args, 6.0)
    for a, b in zip(got, want, strict=True):
        assert bits_equal(a.cpu(), b)


@pytest.mark.parametrize("name", QUANT_RECIPES)
def test_evaluation_without_grad_equals_training_forward(name):
    """Under no_grad and inference_mode the layer skips backward's operands (session 44); the
    output must be the training forward's, bit for bit, on the Hopper path too."""
    torch.manual_seed(0)
    layer = QuantLinear(256, 384, recipe=name, backend="hopper").cuda()
    x, _, _ = _inputs(96, 256, 384)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
        with torch.no_grad():
            y_no_grad = layer(x)
        with torch.inference_mode():
            y_inference = layer(x)
    assert bits_equal(y_no_grad, y.detach())
    assert bits_equal(y_inference, y.detach())
