"""mlp.py: the SwiGLU MLP as one unit (`QuantSwiGLU`, `SwiGLUFunction`).

- fp32: the unit equals the composite (three QuantLinears) bit for bit, y, dx and every dw,
  eagerly and compiled (fullgraph, no recompiles over new data). There the composite's
  SwiGLU runs in float32 too.
- bf16 autocast: the unit keeps h, dg and du in float32 between the bf16 GEMM outputs and the
  casts; the composite rounds some of them to bf16 (eagerly all, compiled where inductor
  stores them), so the unit equals itself compiled, and its accuracy against the float64
  unquantized MLP is the composite's. On the GPU its y and dw_down equal the compiled
  composite's bit for bit.
- Conversion: `fuse_swiglu` / `convert(..., fuse_mlp=True)` on minifloat's Llama and a
  `transformers` LlamaForCausalLM keep parameters and state_dict keys; recipes the unit cannot
  run are refused by convert and left as the composite by `fuse_swiglu`; after `set_recipe` to
  such a recipe the unit computes as the composite.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import minifloat
from bits import bits_equal
from minifloat.mlp import QuantSwiGLU, fuse_swiglu, unit_reason
from minifloat.models.llama import FeedForward, Llama, LlamaConfig
from minifloat.sqnr import sqnr_db

CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
CONFIG = LlamaConfig(dim=64, n_layers=2, n_heads=4, vocab_size=128, ffn_dim=96, max_seq_len=64)
UNIT_RECIPES = ["fp8-tensorwise", "fp8-tensorwise:fast_accum=off"]


class _Holder(nn.Module):
    def __init__(self, ff: nn.Module) -> None:
        super().__init__()
        self.ff = ff

    def forward(self, x):
        return self.ff(x)


def _pair(recipe="fp8-tensorwise", backend="auto", device="cpu", seed=0):
    """(composite, unit): one converted FeedForward, and a deep copy with it fused."""
    torch.manual_seed(seed)
    composite = minifloat.convert(_Holder(FeedForward(CONFIG)).to(device), recipe, backend=backend)
    unit = copy.deepcopy(composite)
    assert fuse_swiglu(unit) == ["ff"]
    return composite, unit


def _run(model, x, autocast, device="cpu"):
    """[y, dx, dw...] of one forward and backward of sum(y²)."""
    model.zero_grad()
    x = x.detach().requires_grad_()
    with torch.autocast(device, torch.bfloat16, enabled=autocast):
        y = model(x)
    y.float().pow(2).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


def _all_equal(a, b) -> bool:
    return all(bits_equal(p, q) and p.dtype == q.dtype for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize("recipe", UNIT_RECIPES)
@pytest.mark.parametrize("tokens", [64, 50])
def test_unit_equals_composite_in_fp32(recipe, tokens):
    composite, unit = _pair(recipe)
    for seed in range(2):
        x = torch.randn(2, tokens // 2, CONFIG.dim, generator=torch.Generator().manual_seed(seed))
        assert _all_equal(_run(unit, x, False), _run(composite, x, False))


def test_compiled_unit_equals_eager_with_no_recompiles():
    composite, unit = _pair()
    compiled = torch.compile(unit, fullgraph=True)
    torch._dynamo.utils.counters.clear()
    for seed, autocast in ((0, False), (1, False), (2, True), (3, True)):
        x = torch.randn(2, 32, CONFIG.dim, generator=torch.Generator().manual_seed(seed))
        assert _all_equal(_run(compiled, x, autocast), _run(unit, x, autocast))
        if not autocast:
            assert _all_equal(_run(compiled, x, autocast), _run(composite, x, autocast))
    # one graph per autocast mode: new data compiles nothing new
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2


def test_bf16_autocast_accuracy_is_the_composites():
    """SQNR of y, dx and the dws against the float64 unquantized MLP: the unit's within 0.5 dB
    of the composite's (they differ by where h, dg and du are rounded to bf16)."""
    composite, unit = _pair()
    x = torch.randn(4, 64, CONFIG.dim, generator=torch.Generator().manual_seed(5))
    exact = copy.deepcopy(composite.ff)
    ref = _Holder(FeedForward(CONFIG)).double()
    ref.ff.load_state_dict({k: v.double() for k, v in exact.state_dict().items()})
    want = _run(ref, x.double(), False)
    got_unit, got_comp = _run(unit, x, True), _run(composite, x, True)
    for name, w, a, b in zip(
        ("y", "dx", "dw1", "dw2", "dw3"), want, got_unit, got_comp, strict=True
    ):
        s_unit, s_comp = sqnr_db(w.float(), a.float()), sqnr_db(w.float(), b.float())
        assert s_unit >= s_comp - 0.5, f"{name}: unit {s_unit:.2f} dB, composite {s_comp:.2f} dB"
        assert s_unit > 15, name


def test_convert_fuses_llama_and_keeps_parameters_and_state_dict():
    torch.manual_seed(0)
    plain = Llama(CONFIG)
    keys = list(plain.state_dict())
    params = [id(p) for p in plain.parameters()]
    model, report = minifloat.convert(plain, "fp8-tensorwise", fuse_mlp=True, return_report=True)
    assert report.fused_mlps == ["layers.0.feed_forward", "layers.1.feed_forward"]
    assert "fused MLP  layers.0.feed_forward" in str(report)
    assert all(isinstance(b.feed_forward, QuantSwiGLU) for b in model.layers)
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 16))
    model.load_state_dict(copy.deepcopy(model.state_dict()))
    unfused = minifloat.convert(copy.deepcopy(Llama(CONFIG)), "fp8-tensorwise")
    unfused.load_state_dict(model.state_dict())
    assert bits_equal(model(tokens), unfused(tokens))


@pytest.mark.parametrize("recipe", ["fp8-rowwise", "fp4", "fp8-delayed", "bf16"])
def test_convert_refuses_recipes_the_unit_cannot_run(recipe):
    assert unit_reason(minifloat.recipes.get(recipe)) is not None
    with pytest.raises(ValueError, match="fuse_mlp"):
        minifloat.convert(Llama(CONFIG), recipe, fuse_mlp=True)


def test_fuse_leaves_mlps_with_an_unconverted_projection():
    model = minifloat.convert(Llama(CONFIG), "fp8-tensorwise", skip="layers.1.feed_forward.w2")
    assert fuse_swiglu(model) == ["layers.0.feed_forward"]
    assert isinstance(model.layers[1].feed_forward, FeedForward)


def test_set_recipe_to_another_recipe_computes_as_the_composite():
    composite, unit = _pair()
    for model in (composite, unit):
        minifloat.set_recipe(model, "fp8-rowwise")
    assert not unit.ff.unit_applies()
    x = torch.randn(2, 16, CONFIG.dim)
    assert _all_equal(_run(unit, x, True), _run(composite, x, True))


def test_transformers_llama_mlp_is_fused_and_equal_in_fp32():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = minifloat.convert(transformers.LlamaForCausalLM(cfg), "fp8-tensorwise")
    fused = copy.deepcopy(hf)
    assert fuse_swiglu(fused) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert list(fused.state_dict()) == list(hf.state_dict())
    tokens = torch.randint(0, 128, (2, 16))
    for model in (hf, fused):
        model.zero_grad()
        model(tokens, labels=tokens).loss.backward()
    grads = [[p.grad for p in m.parameters()] for m in (hf, fused)]
    assert bits_equal(hf(tokens).logits, fused(tokens).logits)
    assert _all_equal(*grads)


def test_mlp_with_another_activation_is_not_fused():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, hidden_act="gelu",
    )  # fmt: skip
    model = minifloat.convert(transformers.LlamaForCausalLM(cfg), "fp8-tensorwise")
    assert fuse_swiglu(model) == []


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 tensor cores")
@pytest.mark.parametrize("tokens", [2048, 1000])
def test_compiled_unit_on_the_gpu(tokens):
    """Under bf16 autocast on FP8 tensor cores: the unit compiled equals the unit eager (its
    forward's h through the compiled twin, its backward through the Triton kernels), and its
    y and dw_down equal the compiled composite's. dx, dw_gate and dw_up are not the composite's
    bits: in the training graph inductor stores dg and du in bf16 between their maxima and
    their casts, where the unit keeps float32 (session 36, docs/hopper_sessions.md)."""
    composite, unit = _pair(device="cuda")
    x = torch.randn(1, tokens, CONFIG.dim, device="cuda")
    x[0, :3] *= 100  # a few outliers
    got = _run(torch.compile(unit), x, True, "cuda")
    assert _all_equal(_run(unit, x, True, "cuda"), got)
    want = _run(torch.compile(composite), x, True, "cuda")
    assert _all_equal(got[:1] + got[3:4], want[:1] + want[3:4])  # y, dw_down (w2)
