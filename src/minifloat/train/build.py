"""Build the parts of a run from its TrainConfig: name checks, dataset, optimizer, batches.

The model has its own module (:mod:`minifloat.train.model`); the loop that uses these parts is
:class:`minifloat.train.trainer.Trainer`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from minifloat import recipes
from minifloat.train.config import TrainConfig, check_model_overrides
from minifloat.train.errors import ConfigError
from minifloat.train.runtime import Runtime
from minifloat.train.switch import check_switch_names

__all__ = ["build_iterator", "build_optimizer", "check_names", "load_dataset", "param_groups"]


def check_names(config: TrainConfig) -> None:
    """Fail fast (before any data work) on an unknown recipe, switch recipe, model, model
    override or optimizer-state name."""
    from minifloat.models.llama import PRESETS

    check_switch_names(config)
    recipes.get(config.recipe)
    if config.model not in PRESETS:
        raise ConfigError(f"unknown model {config.model!r}; choose one of {', '.join(PRESETS)}")
    check_model_overrides(config.model, config.model_overrides)
    if config.optim_states != "fp32":
        from minifloat.optim import OPTIM_STATE_PRESETS

        if config.optim_states not in OPTIM_STATE_PRESETS:
            raise ConfigError(
                f"unknown optimizer states {config.optim_states!r}; choose one of "
                f"{', '.join(OPTIM_STATE_PRESETS)}"
            )


def load_dataset(config: TrainConfig, *, progress: bool = True) -> Any:
    """Build (or load from cache) the TokenDataset that ``config`` trains on."""
    from minifloat.data import build_dataset

    cfg = config.resolved()
    kwargs: dict[str, Any] = {
        "vocab_size": cfg.vocab_size,
        "tokenizer": cfg.tokenizer,
        "seq_len": cfg.seq_len,
        "progress": progress,
    }
    if cfg.cache_dir is not None:
        kwargs["cache_dir"] = Path(cfg.cache_dir)
    if cfg.data_max_bytes:
        kwargs["max_bytes"] = cfg.data_max_bytes
    return build_dataset(cfg.data, **kwargs)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices (linear weights and the embedding), none on norms and biases."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    config: TrainConfig, model: nn.Module, runtime: Runtime, *, lr: float
) -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters: torch's for fp32 states (fused on CUDA, foreach
    otherwise and under FSDP), minifloat's for the low-precision presets (``--optim-states``)."""
    groups = param_groups(model, config.weight_decay)
    kwargs = {"lr": lr, "betas": config.betas, "eps": config.eps}
    if config.optim_states == "fp32":
        fast = {"fused": True} if runtime.device.type == "cuda" else {"foreach": True}
        if config.parallel == "fsdp":
            fast = {"foreach": True}
        return torch.optim.AdamW(groups, **kwargs, **fast)
    from minifloat.optim import OPTIM_STATE_PRESETS, AdamW

    preset = dict(OPTIM_STATE_PRESETS[config.optim_states])
    return AdamW(groups, **kwargs, **preset, seed=config.seed)


def build_iterator(config: TrainConfig, tokens: Any, runtime: Runtime) -> Any:
    """The training BatchIterator: batch k is a pure function of (seed, k, rank), so a resumed
    run sees exactly the batches it would have, and every rank sees different data."""
    from minifloat.data import BatchIterator

    return BatchIterator(
        tokens,
        config.batch_size,
        config.seq_len,
        seed=config.seed,
        rank=runtime.rank,
        world_size=runtime.world_size,
    )
