"""Low-precision optimizer states: AdamW with fp32/bf16/fp16/fp8 moments, presets, memory math."""

from minifloat.optim.adamw import AdamW
from minifloat.optim.codecs import STATE_FORMATS, StateFormat, get_state_format
from minifloat.optim.presets import OPTIM_STATE_PRESETS, bytes_per_param, preset_param_dtype

__all__ = [
    "OPTIM_STATE_PRESETS",
    "STATE_FORMATS",
    "AdamW",
    "StateFormat",
    "bytes_per_param",
    "get_state_format",
    "preset_param_dtype",
]
