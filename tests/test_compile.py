"""QuantLinear under torch.compile on CPU: bit-identical to eager, one graph, no recompiles.

The quantizers are the same PyTorch functions eager and compiled (kernels/operand.py); inductor
may fuse and reorder them but must not change a bit, because divisions are pinned
(`exact.div_rn`) and reductions are maxima (order-independent). fp32 GEMMs are the same ATen
matmul in both modes here, so whole-layer outputs and gradients must be equal too.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from bits import bits_equal
from minifloat import occ_gemm, recipes
from minifloat.linear import QuantLinear

# Every quantized recipe, plus OCC with a strided threshold sample (64 x 128 inputs hold fewer
# entries than the default sample, so the named recipes take the exact quantiles) and with the
# fp32 reference compensation, and power-of-two and fp32 (divided, not the default "inv")
# scales (tensor, and row with OCC and DGE).
RECIPES = [n for n in recipes.names() if recipes.get(n).quantized] + [
    "fp4:occ.sample_size=1024",
    "fp4:occ.compensation_format=fp32",
    "fp4:occ.sample_size=1024:occ.one_gemm=off",
    "fp8-tensorwise:scale_format=pow2",
    "fp4:scale_format=pow2",
    "fp8-tensorwise:scale_format=fp32",
    "fp4:scale_format=fp32",
]
# The micro-block recipes (nvfp4, mxfp4: stochastic rounding, Hadamard transforms) take ~1.5x as
# long to compile on the CPU: they run in the training mode (bf16 autocast) only.
CASES = [
    (name, autocast)
    for name in RECIPES
    for autocast in (False, True)
    if autocast or not recipes.get(name).randomized
]


def _step(module, x, dy, autocast: bool):
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = module(x)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, module.weight.grad.clone()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "autocast"), CASES, ids=[f"{n}-{'bf16-autocast' if a else 'fp32'}" for n, a in CASES]
)
def test_compiled_equals_eager_without_breaks_or_recompiles(name, autocast):
    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator().manual_seed(0)
    eager = QuantLinear(128, 96, bias=False, recipe=name, backend="emulated")
    compiled_layer = copy.deepcopy(eager)
    compiled = torch.compile(compiled_layer, fullgraph=True)
    for step in range(3):  # new data each step: the graph must not be recompiled for it
        x = torch.randn(64, 128, generator=gen) * (1 + step)
        x[step, :4] *= 50.0  # outliers move around
        dy = torch.randn(64, 96, generator=gen)
        eager.weight.grad = compiled_layer.weight.grad = None
        want = _step(eager, x, dy, autocast)
        got = _step(compiled, x, dy, autocast)
        for key, a, b in zip(("y", "dx", "dw"), want, got, strict=True):
            assert a.dtype == b.dtype and bits_equal(a, b), (
                f"{name} step {step}: compiled {key} differs from eager"
            )
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def _one_step_compiled_equals_eager(
    name: str, k: int, n: int, m: int, *, options: dict | None = None, outliers: bool = False,
    autocast: bool = True,
) -> None:  # fmt: skip
    """One step (bf16 autocast, unless not `autocast`) of a [k -> n] layer on m tokens, compiled
    (inductor `options`) and eager: y, dx and dw bit for bit."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    eager = QuantLinear(k, n, bias=False, recipe=name, backend="emulated")
    compiled_layer = copy.deepcopy(eager)
    compiled = torch.compile(compiled_layer, fullgraph=True, options=options)
    x, dy = torch.randn(m, k, generator=gen), torch.randn(m, n, generator=gen)
    if outliers:
        x[3, :4] *= 50.0
    want, got = _step(eager, x, dy, autocast), _step(compiled, x, dy, autocast)
    for key, a, b in zip(("y", "dx", "dw"), want, got, strict=True):
        assert a.dtype == b.dtype and bits_equal(a, b), f"compiled {key} differs from eager"


@pytest.mark.slow
def test_cpp_wrapper_compiled_equals_eager():
    # inductor's C++ wrapper (the graphs' launcher code in C++, not Python) around fp4's graphs,
    # which hold the Library ops (the opaque float64 reciprocal) and OCC's sort
    options = {"cpp_wrapper": True}
    _one_step_compiled_equals_eager("fp4", 128, 96, 64, options=options, outliers=True)


# Block-scaled layers at shapes inductor's C++ code generator (torch 2.13) got wrong: a 256-wide
# layer whose token count differs from its width failed an assertion in its loop split, and a
# token count that ends in a partial block lost that block's columns of the wgrad operand (a
# silently wrong dw; pytorch/pytorch#195582). kernels/backend.py works around both (session 48).
BLOCK_CASES = [("fp8-blockwise", 256, 256, 64), ("fp8-blockwise", 128, 96, 200),
               ("mxfp4", 128, 96, 200)]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("name", "k", "n", "m"), BLOCK_CASES)
def test_block_scaled_compiled_equals_eager_at_awkward_shapes(name, k, n, m):
    _one_step_compiled_equals_eager(name, k, n, m)


# The fp32 reference compensation at contractions of 256 (256 tokens: wgrad's; K = 256: fprop's
# too): inductor rewrites an fp32 `mm(a, b) + c` into `addmm(c, a, b)` on the CPU, whose BLAS
# sums c in with the products in another order, so eager's mm and add gave other last bits (dw
# in both cases, y at K = 256 in fp32) until the GEMMs became an opaque op (occ_gemm.fp32_mm,
# session 84).
@pytest.mark.slow
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize(("k", "n"), [(256, 128), (128, 256)])
def test_fp32_compensation_compiled_equals_eager_at_long_contractions(k, n, autocast):
    name = "fp4:occ.compensation_format=fp32"
    _one_step_compiled_equals_eager(name, k, n, 256, outliers=True, autocast=autocast)


def test_fp32_mm_is_float32_under_autocast_and_one_graph_node():
    """The op takes any layout and dtype, computes in float32 under bf16 autocast too, and stays
    one opaque node when compiled (no graph break, eager's bits)."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(300, 64, generator=gen).bfloat16(), torch.randn(48, 300, generator=gen)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda p, q: occ_gemm.fp32_mm(p.t(), q.t()), fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = occ_gemm.fp32_mm(a.t(), b.t()), compiled(a, b)
    assert want.dtype == got.dtype == torch.float32 and bits_equal(got, want)
    assert torch.equal(want, a.float().t().contiguous() @ b.t().contiguous())
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


@pytest.mark.parametrize("name", ["fp8-tensorwise", "fp4"])
def test_transformers_blocks_share_one_graph(name):
    """A converted `transformers` Llama compiled block by block (as benchmarks/train_e2e.py
    does): the identical blocks share one graph over steps with new data, without graph
    breaks, when the model runs without a KV cache (with one, every block recompiles)."""
    transformers = pytest.importorskip("transformers")
    import minifloat

    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=256, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    net = minifloat.convert(transformers.LlamaForCausalLM(cfg), name, backend="emulated")
    blocks = net.model.layers
    for i, block in enumerate(blocks):
        blocks[i] = torch.compile(block, backend="eager")
    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(0, 256, (2, 32), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            net(ids, labels=ids).loss.backward()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


class _SharedInput(torch.nn.Module):
    """`n` layers reading one input, as q/k/v or gate/up do."""

    def __init__(self, name: str, n: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            QuantLinear(64, 64, bias=False, recipe=name, backend="emulated") for _ in range(n)
        )

    def forward(self, x):
        return sum(layer(x) for layer in self.layers)


def _quantized_copies_of_input(name: str, n_layers: int) -> int:
    """Casts to a one-byte float of the input's shape in the compiled forward graph."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    casts = []

    def fw_compiler(gm, _inputs):
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if (
                node.target
                in (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)
                and isinstance(val, torch.Tensor)
                and val.dtype.is_floating_point
                and val.dtype.itemsize == 1
                and tuple(val.shape) == (32, 64)
            ):
                casts.append(node.name)
        return make_boxed_func(gm)

    backend = aot_autograd(
        fw_compiler=fw_compiler,
        bw_compiler=lambda gm, _inputs: make_boxed_func(gm),
        partition_fn=min_cut_rematerialization_partition,
    )
    torch._dynamo.reset()
    module = torch.compile(_SharedInput(name, n_layers), backend=backend)
    x = torch.randn(32, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        module(x).float().sum().backward()
    return len(casts)


# Recipes whose input scale is the input's own: delayed scaling reads each layer's history, and
# the randomized recipes draw each layer's own numbers, so their layers quantize differently.
SHAREABLE = [n for n in RECIPES if not recipes.get(n).randomized and recipes.get(n).delayed is None]


@pytest.mark.parametrize("name", SHAREABLE)
def test_layers_sharing_an_input_quantize_it_once(name):
    # Common-subexpression elimination must see the layers' quantizers of one input as equal:
    # a NaN literal in a scale (NaN != NaN) once made q/k/v each quantize and save x again.
    # Two layers show it as well as three (q/k/v) and compile in two thirds of the time.
    one, two = _quantized_copies_of_input(name, 1), _quantized_copies_of_input(name, 2)
    assert one >= 1
    assert two == one
