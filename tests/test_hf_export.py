"""Export to the Hugging Face LLaMA layout: same logits from transformers.LlamaForCausalLM."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from minifloat.models import Llama, export_hf, get_config

transformers = pytest.importorskip("transformers", reason="transformers is not installed")


def _model(**overrides) -> Llama:
    config = get_config("tiny", vocab_size=300, dim=64, max_seq_len=64, **overrides)
    model = Llama(config)
    model.init_weights(1)
    return model


def _hf_logits(path, tokens):
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(tokens).logits


# n_kv_heads=2 checks the GQA head layout; rope_theta=5000 checks the base reaches HF.
@pytest.mark.parametrize("overrides", [{}, {"n_kv_heads": 2, "rope_theta": 5000.0}])
def test_hf_logits_match(tmp_path, overrides):
    model = _model(**overrides)
    export_hf(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    tokens = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
    # Two implementations of one fp32 forward (their op order may differ): ~1e-6 on logits < 1
    # (measured 0 today); a wrong weight layout or RoPE convention moves them by ~0.1.
    torch.testing.assert_close(_hf_logits(tmp_path, tokens), ours, rtol=0, atol=1e-4)


class _FakeQuantLinear(nn.Linear):
    """Like QuantLinear: same high-precision weight, but a lossy forward."""

    def forward(self, x):
        return nn.functional.linear(x, self.weight.to(torch.bfloat16).float())


def test_quantized_layers_export_high_precision_weights(tmp_path):
    model = _model()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    for block in model.layers:
        old = block.feed_forward.w1
        new = _FakeQuantLinear(old.in_features, old.out_features, bias=False)
        new.weight = old.weight
        block.feed_forward.w1 = new
    export_hf(model, tmp_path)
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(
        tensors["model.layers.0.mlp.gate_proj.weight"], reference["layers.0.feed_forward.w1.weight"]
    )
    plain = _model()
    tokens = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        expected = plain(tokens)
    # as in test_hf_logits_match
    torch.testing.assert_close(_hf_logits(tmp_path, tokens), expected, rtol=0, atol=1e-4)


def test_export_rejects_other_models(tmp_path):
    with pytest.raises(TypeError, match="Llama"):
        export_hf(nn.Linear(2, 2), tmp_path)


def test_export_never_replaces_files_unless_told(tmp_path):
    """It overwrote an earlier model.safetensors without a word (export_run guarded this;
    export_hf, the public function, did not)."""
    (tmp_path / "model.safetensors").write_text("an earlier export")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="already holds model.safetensors: pass overwrite=True"):
        export_hf(_model(), tmp_path)
    assert (tmp_path / "model.safetensors").read_text() == "an earlier export"
    assert not (tmp_path / "config.json").exists()
    export_hf(_model(), tmp_path, overwrite=True)
    tokens = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        expected = _model()(tokens)
    torch.testing.assert_close(_hf_logits(tmp_path, tokens), expected, rtol=0, atol=1e-4)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    # an earlier tokenizer.json stays, and may not suit the new model: said, not deleted
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.warns(UserWarning, match="keeps the tokenizer.json of an earlier export"):
        export_hf(_model(), tmp_path, overwrite=True)
    assert (tmp_path / "tokenizer.json").read_text() == "{}"


def test_export_refuses_bad_destinations_and_tokenizers(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="afile is a file, not a directory"):
        export_hf(_model(), tmp_path / "afile")
    # a string or another library's tokenizer was skipped silently: no tokenizer.json
    with pytest.raises(TypeError, match="tokenizer must be a minifloat tokenizer .*got str"):
        export_hf(_model(), tmp_path / "out", tokenizer="gpt2")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="on the meta device"):
        export_hf(Llama(get_config("tiny", vocab_size=300, dim=64)).to("meta"), tmp_path / "m")


def test_export_after_quantized_all_gather(tmp_path):
    """Its weights are ShardedWeight parameters, a tensor subclass that survived the export's
    detach/to/clone, and safetensors could not read its storage."""
    import minifloat
    from minifloat.fsdp_quantized import enable_quantized_all_gather

    model = minifloat.convert(_model(), "fp8-tensorwise")
    reference = model.layers[0].attention.wq.weight.detach().clone()
    assert enable_quantized_all_gather(model) > 0
    export_hf(model, tmp_path)
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(tensors["model.layers.0.self_attn.q_proj.weight"], reference)


def test_export_writes_tokenizer_loadable_by_auto_tokenizer(tmp_path):
    from minifloat.data import train_bpe

    texts = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n"] * 50
    tokenizer = train_bpe(texts, vocab_size=300)
    export_hf(_model(), tmp_path, tokenizer=tokenizer)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    sample = "def sub(a, b):\n    return a - b\n"
    assert hf_tok(sample)["input_ids"] == tokenizer.encode(sample)
    assert hf_tok.decode(tokenizer.encode(sample)) == sample
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == tokenizer.eos_id


def test_hf_config_takes_a_llama_config():
    from minifloat.models.hf_export import hf_config

    model = Llama(get_config("tiny", n_layers=1, vocab_size=64))
    with pytest.raises(TypeError, match=r"hf_config takes a LlamaConfig \(model.config\)"):
        hf_config(model)
    assert hf_config(model.config)["model_type"] == "llama"
