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
from minifloat import recipes
from minifloat.linear import QuantLinear

# Every quantized recipe, plus OCC with a strided threshold sample (64 x 128 inputs hold fewer
# entries than the default sample, so the named recipes take the exact quantiles) and with the
# fp32 reference compensation.
RECIPES = [n for n in recipes.names() if recipes.get(n).quantized] + [
    "fp4:occ.sample_size=1024",
    "fp4:occ.compensation_format=fp32",
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
