"""convert(): which layers are swapped, reports, state_dicts, and a short training run."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from torch import nn

from minifloat import recipes
from minifloat.convert import AlreadyConvertedError, ConversionReport, convert
from minifloat.linear import QuantLinear
from minifloat.models.llama import Llama, LlamaConfig
from minifloat.occ import occ_activation
from minifloat.sqnr import sqnr_db

TINY = LlamaConfig(dim=64, n_layers=2, n_heads=4, ffn_dim=128, vocab_size=64, max_seq_len=32)
TRAIN = LlamaConfig(dim=128, n_layers=2, n_heads=4, ffn_dim=256, vocab_size=64, max_seq_len=32)
BLOCK_LINEARS = (
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)


def tiny_llama(config: LlamaConfig = TINY, seed: int = 0) -> Llama:
    model = Llama(config)
    model.init_weights(seed)
    return model


def test_swaps_the_right_layers_of_llama():
    model = tiny_llama()
    params_before = {n: p for n, p in model.named_parameters()}
    report = convert(model, "fp4")
    expected = [f"layers.{i}.{name}" for i in range(2) for name in BLOCK_LINEARS]
    assert sorted(report.converted) == sorted(expected)
    assert dict(report.skipped) == {
        "tok_embeddings": "embedding (kept in high precision)",
        "output": "output head (kept in high precision)",
    }
    for name in expected:
        assert isinstance(model.get_submodule(name), QuantLinear)
    assert type(model.output) is nn.Linear
    # parameters are the same objects: an optimizer built before convert() stays valid
    assert all(p is params_before[n] for n, p in model.named_parameters())
    text = str(report)
    assert "fp4" in text and "14 linear layers converted" in text and "output head" in text


def test_converted_state_dict_loads_into_original():
    model = tiny_llama()
    converted = copy.deepcopy(model)
    convert(converted, "fp8-delayed")
    assert list(converted.state_dict()) == list(model.state_dict())
    fresh = Llama(TINY)
    fresh.load_state_dict(converted.state_dict(), strict=True)
    for (n, a), (_, b) in zip(fresh.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


def test_bf16_preserves_outputs_and_fp8_stays_close():
    model = tiny_llama()
    tokens = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(tokens)
        bf16 = copy.deepcopy(model)
        report = convert(bf16, "bf16")
        assert report.converted == []
        assert all("autocast only" in r for n, r in report.skipped if "layers" in n)
        assert torch.equal(bf16(tokens), ref)
        fp8 = copy.deepcopy(model)
        convert(fp8, "fp8-rowwise")
        err = (fp8(tokens) - ref).norm() / ref.norm()
    assert 0 < err.item() < 0.05


def test_unsuitable_dims_are_reported():
    model = nn.Sequential(nn.Linear(64, 60), nn.ReLU(), nn.Linear(60, 32), nn.Linear(32, 128))
    report = convert(model, "fp8-tensorwise")
    assert report.converted == ["3"]
    reasons = dict(report.skipped)
    assert "multiples of 16" in reasons["0"] and "multiples of 16" in reasons["2"]
    # blockwise needs 128: the tiny llama's attention (64) is skipped with the reason
    block = convert(tiny_llama(), "fp8-blockwise")
    assert block.converted == []
    assert all("multiples of 128" in r for n, r in block.skipped if n.startswith("layers"))


def test_skip_rules():
    model = tiny_llama()
    report = convert(model, "fp4", skip="layers.0.*")
    assert all(n.startswith("layers.1.") for n in report.converted)
    assert ("layers.0.attention.wq", "matched skip") in report.skipped
    model = tiny_llama()
    report = convert(model, "fp4", skip=lambda fqn, m: m.out_features == TINY.ffn_dim)
    assert "layers.0.feed_forward.w1" not in report.converted
    assert "layers.0.feed_forward.w2" in report.converted
    model = tiny_llama()
    report = convert(model, "fp4", keep_head=False)
    assert "output" in report.converted and isinstance(model.output, QuantLinear)


def test_converting_twice_raises():
    model = tiny_llama()
    convert(model, "fp4")
    with pytest.raises(AlreadyConvertedError, match="already converted"):
        convert(model, "fp8-rowwise")


def test_report_type_and_unknown_recipe():
    assert isinstance(convert(nn.Linear(16, 16), "fp4"), ConversionReport)  # root has no name
    with pytest.raises(ValueError, match="unknown recipe"):
        convert(tiny_llama(), "fp5")


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)
def test_transformers_llama():
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    cfg = HFConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    tokens = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        ref = model(tokens).logits
    report = convert(model, "fp4")
    projs = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
    assert sorted(report.converted) == sorted(
        f"model.layers.{i}.{p}" for i in range(2) for p in projs
    )
    assert {n for n, _ in report.skipped} == {"model.embed_tokens", "lm_head"}
    with torch.no_grad():
        out = model(tokens).logits
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert not torch.equal(out, ref)


# ---------------------------------------------------------------------------------------------
# A tiny model trained for a few dozen steps under fp4 and fp4-direct
# ---------------------------------------------------------------------------------------------


def _batches(n: int, batch: int = 8, seq: int = 32, vocab: int = 64):
    """A learnable synthetic language: each token is a fixed function of the two before it."""
    gen = torch.Generator().manual_seed(1)
    table = torch.randint(0, vocab, (vocab, vocab), generator=gen)
    for _ in range(n):
        t = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        for i in range(2, seq + 1):
            t[:, i] = table[t[:, i - 2], t[:, i - 1]]
        yield t[:, :-1], t[:, 1:]


def _train(recipe: str, steps: int = 40) -> tuple[list[float], float]:
    model = tiny_llama(TRAIN)
    convert(model, recipe, backend="emulated")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for inputs, targets in _batches(steps):
        logits = model(inputs)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # activation fidelity of every converted layer's input under the recipe's own treatment
    r = recipes.get(recipe)
    sqnrs: list[float] = []

    def hook(module, args, output):
        x = args[0].detach().reshape(-1, args[0].shape[-1])
        x_hat = occ_activation(x, r.fprop.lhs.fmt, r.fprop.lhs.granularity, r.occ)
        sqnrs.append(sqnr_db(x, x_hat))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, QuantLinear)]
    with torch.no_grad():
        model(next(_batches(1))[0])
    for h in handles:
        h.remove()
    return losses, torch.tensor(sqnrs)


@pytest.mark.slow
def test_tiny_model_trains_under_fp4_and_occ_improves_activation_sqnr():
    losses, sqnr_fp4 = _train("fp4")
    assert all(torch.isfinite(torch.tensor(losses)))
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.3, (first, last)
    _, sqnr_direct = _train("fp4-direct")
    # Per layer input, OCC (clamp at 0.99 + compensation) beats the direct cast; the activations
    # of this tiny model are near-Gaussian, so the mean gain (~1.4 dB) is far below Table 1's.
    assert (sqnr_fp4 > sqnr_direct).float().mean() >= 0.8, (sqnr_fp4, sqnr_direct)
    assert sqnr_fp4.mean() > sqnr_direct.mean() + 0.5, (sqnr_fp4, sqnr_direct)
