"""Export a minifloat ``Llama`` to the Hugging Face ``LlamaForCausalLM`` layout.

Writes ``model.safetensors`` and ``config.json`` into a directory that
``transformers.LlamaForCausalLM.from_pretrained`` loads directly and that gives the same logits.
No q/k permutation is needed because our RoPE already uses HF's rotate-half convention.
Quantized layers (``QuantLinear``, a subclass of ``nn.Linear``) export their high-precision
``weight``: the checkpoint is always a plain floating-point model.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from torch import nn

from minifloat.models.llama import Llama, LlamaConfig

__all__ = ["export_hf", "hf_config", "hf_state_dict"]

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_config(config: LlamaConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` dictionary for ``config``.

    Both the legacy ``rope_theta`` key (transformers 4.x) and ``rope_parameters``
    (transformers 5.x) are written so either major version reads the right base.
    """
    if not isinstance(config, LlamaConfig):
        raise TypeError(
            f"hf_config takes a LlamaConfig (model.config), got {type(config).__name__}"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": _DTYPE_NAMES[dtype],
        "initializer_range": 0.02,
        "use_cache": True,
    }


def _full(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if weight.is_meta:
        raise ValueError("the model's weights are on the meta device (never materialized)")
    # FSDP2 shards parameters as DTensors; gather the whole matrix before saving.
    if hasattr(weight, "full_tensor"):
        weight = weight.full_tensor()
    # Copied into a plain tensor: a tensor subclass (the quantized all-gather's ShardedWeight)
    # survives detach/to/clone, and safetensors cannot read its storage.
    full = torch.empty(weight.shape, dtype=dtype, device="cpu")
    return full.copy_(weight.detach())


def _unwrap(model: nn.Module) -> Llama:
    # torch.compile keeps the module in _orig_mod, DDP in .module.
    for attr in ("_orig_mod", "module"):
        while hasattr(model, attr) and isinstance(getattr(model, attr), nn.Module):
            model = getattr(model, attr)
    if not isinstance(model, Llama):
        raise TypeError(f"export_hf expects a minifloat Llama, got {type(model).__name__}")
    return model


def hf_state_dict(model: nn.Module, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Map our parameter names to Hugging Face LLaMA names (high-precision weights, on CPU)."""
    llama = _unwrap(model)
    tensors = {
        "model.embed_tokens.weight": _full(llama.tok_embeddings.weight, dtype),
        "model.norm.weight": _full(llama.norm.weight, dtype),
        "lm_head.weight": _full(llama.output.weight, dtype),
    }
    for i, block in enumerate(llama.layers):
        prefix = f"model.layers.{i}."
        attn, ffn = block.attention, block.feed_forward
        pairs = {
            "self_attn.q_proj": attn.wq,
            "self_attn.k_proj": attn.wk,
            "self_attn.v_proj": attn.wv,
            "self_attn.o_proj": attn.wo,
            "mlp.gate_proj": ffn.w1,
            "mlp.up_proj": ffn.w3,
            "mlp.down_proj": ffn.w2,
            "input_layernorm": block.attention_norm,
            "post_attention_layernorm": block.ffn_norm,
        }
        for hf_name, module in pairs.items():
            tensors[f"{prefix}{hf_name}.weight"] = _full(module.weight, dtype)
    return tensors


def export_hf(
    model: nn.Module,
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    tokenizer: object | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model.safetensors`` + ``config.json`` (HF LlamaForCausalLM) into directory ``path``.

    ``tokenizer``: optionally a minifloat tokenizer with ``save_hf(directory)``; it then also
    writes ``tokenizer.json`` so ``PreTrainedTokenizerFast`` can load it. Refuses (ValueError,
    before writing anything) to replace a file of those names unless ``overwrite``; a
    ``tokenizer.json`` of an earlier export is left as it is when no tokenizer is given, with a
    warning (it may not suit the new model). Returns ``path``.
    """
    from safetensors.torch import save_file

    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(_DTYPE_NAMES)}, got {dtype}")
    if tokenizer is not None and not callable(getattr(tokenizer, "save_hf", None)):
        kind = type(tokenizer).__name__
        raise TypeError(f"tokenizer must be a minifloat tokenizer (with save_hf), got {kind}")
    llama = _unwrap(model)
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file, not a directory")
    names = ["model.safetensors", "config.json"]
    names += ["tokenizer.json"] if tokenizer is not None else []
    existing = [n for n in names if (out / n).exists()]
    if existing and not overwrite:
        raise ValueError(f"{out} already holds {', '.join(existing)}: pass overwrite=True")
    if tokenizer is None and (out / "tokenizer.json").exists():
        warnings.warn(
            f"{out} keeps the tokenizer.json of an earlier export: pass the tokenizer, or "
            "remove it if it does not suit this model",
            UserWarning,
            stacklevel=2,
        )
    out.mkdir(parents=True, exist_ok=True)
    save_file(hf_state_dict(llama, dtype), str(out / "model.safetensors"), {"format": "pt"})
    config = hf_config(llama.config, dtype)
    if tokenizer is not None:
        tokenizer.save_hf(out)
        config["eos_token_id"] = getattr(tokenizer, "eos_id", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
