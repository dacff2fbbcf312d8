"""Reference models: LLaMA-2 and its Hugging Face export."""

from minifloat.models.hf_export import export_hf, hf_config, hf_state_dict
from minifloat.models.llama import (
    PRESETS,
    Llama,
    LlamaConfig,
    RMSNorm,
    TransformerBlock,
    get_config,
)

__all__ = [
    "PRESETS",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "TransformerBlock",
    "export_hf",
    "get_config",
    "hf_config",
    "hf_state_dict",
]
