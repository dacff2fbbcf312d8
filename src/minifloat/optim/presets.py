"""Named optimizer-state configurations and their memory cost per parameter.

A preset is the keyword arguments for minifloat.optim.AdamW (plus nothing else), so the CLI's
`--optim-states NAME` maps to `AdamW(params, lr=..., **OPTIM_STATE_PRESETS[NAME])`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from minifloat.optim.adamw import MASTER_MODES, AdamW
from minifloat.optim.codecs import check_block_size, get_state_format

__all__ = ["OPTIM_STATE_PRESETS", "bytes_per_param", "preset_param_dtype"]

OPTIM_STATE_PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        # torch.optim.AdamW semantics: the reference.
        "fp32": MappingProxyType(
            {"exp_avg_dtype": "fp32", "exp_avg_sq_dtype": "fp32", "master_weights": "fp32"}
        ),
        # DeepSeek-V3: both moments bf16, fp32 master weights.
        "bf16": MappingProxyType(
            {"exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16", "master_weights": "fp32"}
        ),
        # arXiv 2501.17116 / MS-AMP: first moment fp8 e4m3, second fp16, fp32 master weights.
        "fp8-fp16": MappingProxyType(
            {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp16", "master_weights": "fp32"}
        ),
        # Leanest: 8-bit moments, bf16 weights without master (stochastic rounding).
        "lean": MappingProxyType(
            {
                "exp_avg_dtype": "fp8",
                "exp_avg_sq_dtype": "fp8-sqrt",
                "master_weights": "none",
            }
        ),
    }
)


# The keys a configuration may hold: AdamW's keyword arguments. Only exp_avg_dtype,
# exp_avg_sq_dtype, master_weights and block_size change the memory; a typo among them would
# otherwise silently price fp32 states.
_CONFIG_KEYS = tuple(
    name for name in inspect.signature(AdamW.__init__).parameters if name not in ("self", "params")
)
# bytes per element of each parameter dtype `bytes_per_param` prices
_PARAM_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}


def preset_param_dtype(config: str | Mapping[str, Any]) -> str:
    """Parameter dtype a configuration is meant for: bf16 without master weights, else fp32."""
    kwargs = _kwargs(config)
    return "bf16" if kwargs.get("master_weights", "fp32") == "none" else "fp32"


def bytes_per_param(
    config: str | Mapping[str, Any],
    *,
    param_dtype: str | None = None,
    block_size: int | None = None,
) -> dict[str, float]:
    """Persistent training memory per parameter of a large 2-D weight, in bytes.

    Returns {"weights", "grads", "exp_avg", "exp_avg_sq", "master", "total"}. Gradients have the
    parameter dtype; block-scaled states include their fp32 scales (4 / block_size bytes).
    `config`: a preset name or a dict of AdamW keyword arguments (other keys are refused);
    `param_dtype`: "fp32", "bf16" or "fp16" (default: the configuration's, `preset_param_dtype`);
    `block_size`: overrides the configuration's, an int in [1, 2**16] as AdamW takes.
    Small and 1-D tensors keep fp32 states and are ignored here (a negligible share of a LLM).
    """
    kwargs = _kwargs(config)
    if param_dtype is None:
        param_dtype = preset_param_dtype(kwargs)
    if not isinstance(param_dtype, str) or param_dtype not in _PARAM_BYTES:
        raise ValueError(
            f"param_dtype must be one of {', '.join(_PARAM_BYTES)} (a name), got {param_dtype!r}"
        )
    if block_size is None:  # not `or`: block_size=0 must fail, not price 128
        block_size = kwargs.get("block_size", 128)
    check_block_size(block_size)
    weight_bytes = _PARAM_BYTES[param_dtype]
    master = 4.0 if kwargs.get("master_weights", "fp32") == "fp32" and weight_bytes < 4 else 0.0
    out = {
        "weights": weight_bytes,
        "grads": weight_bytes,
        "exp_avg": get_state_format(kwargs.get("exp_avg_dtype", "fp32")).bytes_per_element(
            block_size
        ),
        "exp_avg_sq": get_state_format(kwargs.get("exp_avg_sq_dtype", "fp32")).bytes_per_element(
            block_size
        ),
        "master": master,
    }
    out["total"] = sum(out.values())
    return out


def _kwargs(config: str | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(config, str):
        if config not in OPTIM_STATE_PRESETS:
            raise ValueError(
                f"unknown optimizer-state preset {config!r}; choose one of "
                f"{sorted(OPTIM_STATE_PRESETS)}"
            )
        return OPTIM_STATE_PRESETS[config]
    if not isinstance(config, Mapping):
        raise TypeError(
            f"an optimizer-state configuration is a preset name or a dict of AdamW keyword "
            f"arguments, got {type(config).__name__}"
        )
    unknown = [key for key in config if key not in _CONFIG_KEYS]
    if unknown:
        raise ValueError(
            f"unknown optimizer-state configuration key {unknown[0]!r}; valid keys: "
            f"{', '.join(_CONFIG_KEYS)}"
        )
    if config.get("master_weights", "fp32") not in MASTER_MODES:
        raise ValueError(
            f"master_weights must be one of {MASTER_MODES}, got {config['master_weights']!r}"
        )
    for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        get_state_format(config.get(key, "fp32"))
    if "block_size" in config:
        check_block_size(config["block_size"])
    return config
