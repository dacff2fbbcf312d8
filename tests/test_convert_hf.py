"""convert() on real `transformers` models (tiny configs, random weights, no downloads).

For each architecture: which layers are swapped, that every matrix parameter left alone is in
the report with a reason (nothing silent), that state_dict keys and shapes are unchanged, that
the converted model's logits stay within the recipe's SQNR of the original's, and that backward
reaches every converted weight.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from minifloat.conv1d import QuantConv1D
from minifloat.convert import REPORT_ATTR, convert
from minifloat.linear import QuantLinear
from minifloat.sqnr import sqnr_db
from tolerances import HF_LOGITS_SQNR_MAX_DB, HF_LOGITS_SQNR_MIN_DB

transformers = pytest.importorskip("transformers")

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)

DECODER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
DENSE_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SHARED_EXPERT = tuple(f"mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj"))


def _per_layer(prefix: str, names: tuple[str, ...]) -> set[str]:
    return {f"{prefix}.{i}.{name}" for i in range(2) for name in names}


# name: (build, layers expected converted, names expected in the report's skipped list)
MODELS = {
    "llama": (
        lambda: transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**COMMON, num_key_value_heads=2)
        ),
        _per_layer("model.layers", DECODER + DENSE_MLP),
        {"model.embed_tokens", "lm_head"},
    ),
    "mistral": (
        lambda: transformers.MistralForCausalLM(
            transformers.MistralConfig(**COMMON, num_key_value_heads=2)
        ),
        _per_layer("model.layers", DECODER + DENSE_MLP),
        {"model.embed_tokens", "lm_head"},
    ),
    "qwen2": (
        lambda: transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**COMMON, num_key_value_heads=2)
        ),
        _per_layer("model.layers", DECODER + DENSE_MLP),
        {"model.embed_tokens", "lm_head"},
    ),
    "gpt2": (
        lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=VOCAB,
                n_embd=64,
                n_layer=2,
                n_head=4,
                n_positions=64,
                bos_token_id=0,
                eos_token_id=0,
            )
        ),
        _per_layer("transformer.h", ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")),
        {"transformer.wte", "transformer.wpe", "lm_head"},
    ),
    "bert": (
        lambda: transformers.BertForMaskedLM(transformers.BertConfig(**COMMON)),
        _per_layer(
            "bert.encoder.layer",
            (
                "attention.self.query",
                "attention.self.key",
                "attention.self.value",
                "attention.output.dense",
                "intermediate.dense",
                "output.dense",
            ),
        )
        | {"cls.predictions.transform.dense"},
        {
            "bert.embeddings.word_embeddings",
            "bert.embeddings.position_embeddings",
            "bert.embeddings.token_type_embeddings",
            "cls.predictions.decoder",  # tied to word_embeddings: the output head
        },
    ),
    "mixtral": (
        lambda: transformers.MixtralForCausalLM(
            transformers.MixtralConfig(
                **COMMON, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
            )
        ),
        _per_layer("model.layers", DECODER),
        {"model.embed_tokens", "lm_head"}
        | _per_layer("model.layers", ("mlp.gate.weight", "mlp.experts.gate_up_proj"))
        | _per_layer("model.layers", ("mlp.experts.down_proj",)),
    ),
    "qwen2-moe": (
        lambda: transformers.Qwen2MoeForCausalLM(
            transformers.Qwen2MoeConfig(
                **COMMON,
                num_key_value_heads=2,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=64,
            )
        ),
        _per_layer("model.layers", DECODER + SHARED_EXPERT),
        {"model.embed_tokens", "lm_head"}
        | _per_layer("model.layers", ("mlp.gate.weight", "mlp.experts.gate_up_proj"))
        | _per_layer("model.layers", ("mlp.experts.down_proj", "mlp.shared_expert_gate")),
    ),
}


def _build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name][0]().eval()


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("recipe", list(HF_LOGITS_SQNR_MIN_DB))
@pytest.mark.parametrize("name", list(MODELS))
def test_convert_real_model(name: str, recipe: str) -> None:
    original = _build(name)
    tokens = _tokens()
    with torch.no_grad():
        ref = original(tokens).logits
    model = copy.deepcopy(original)
    params_before = dict(model.named_parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # something is converted: no warning
        returned, report = convert(model, recipe, return_report=True)
    assert returned is model and getattr(model, REPORT_ATTR) is report

    _, expected_converted, expected_skipped = MODELS[name]
    assert set(report.converted) == expected_converted
    assert {n for n, _ in report.skipped} == expected_skipped
    for fqn in report.converted:
        assert isinstance(model.get_submodule(fqn), QuantLinear | QuantConv1D), fqn
    # Nothing silent: every matrix parameter is in a converted layer or in the report.
    accounted = set(report.converted) | {n for n, _ in report.skipped}
    for pname, param in original.named_parameters():
        if param.dim() >= 2:
            assert pname in accounted or pname.rpartition(".")[0] in accounted, pname
    # Same parameter objects, same state_dict keys and shapes.
    assert all(p is params_before[n] for n, p in model.named_parameters())
    shapes = {k: tuple(v.shape) for k, v in original.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == shapes

    out = model(tokens).logits
    assert out.shape == ref.shape
    assert HF_LOGITS_SQNR_MIN_DB[recipe] < sqnr_db(ref, out.detach()) < HF_LOGITS_SQNR_MAX_DB
    out.float().square().mean().backward()
    for fqn in report.converted:
        grad = model.get_submodule(fqn).weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, fqn


def test_gpt2_converted_trains_and_keeps_optimizer() -> None:
    model = _build("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built before convert()
    convert(model, "fp8-tensorwise", backend="emulated")
    c_fc = model.transformer.h[0].mlp.c_fc
    before = c_fc.weight.detach().clone()
    tokens = _tokens()
    losses = []
    for _ in range(5):
        loss = model(tokens, labels=tokens).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert not torch.equal(c_fc.weight, before)  # the optimizer updates the shared parameter
    assert losses[-1] < losses[0]


def test_tied_head_is_found_by_identity_and_converts_with_keep_head_false() -> None:
    # BERT's decoder is named "decoder", no head name: only the tied weight identifies it.
    model = _build("bert")
    report = convert(model, "fp4").minifloat_report
    reason = dict(report.skipped)["cls.predictions.decoder"]
    assert "tied to embedding 'bert.embeddings.word_embeddings'" in reason
    assert type(model.cls.predictions.decoder) is nn.Linear
    untouched = _build("bert")
    convert(untouched, "fp4", keep_head=False)
    decoder = untouched.cls.predictions.decoder
    assert isinstance(decoder, QuantLinear)
    assert decoder.weight is untouched.bert.embeddings.word_embeddings.weight  # still tied


def test_moe_with_only_experts_warns() -> None:
    # With the attention projections kept by the user, a Mixtral converts nothing: the fused
    # experts cannot be, and the call says so instead of returning silently.
    model = _build("mixtral")
    with pytest.warns(UserWarning, match=r"converted no layer: all \d+ linear layers were kept"):
        convert(model, "fp8-tensorwise", skip="*self_attn*")
    skipped = dict(model.minifloat_report.skipped)
    assert "fused MoE expert weights" in skipped["model.layers.0.mlp.experts.gate_up_proj"]
    assert "MixtralTopKRouter" in skipped["model.layers.0.mlp.gate.weight"]
