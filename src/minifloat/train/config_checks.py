"""The value rules of a :class:`~minifloat.train.config.TrainConfig`, one group per function.

Each rule raises a one-line :class:`ConfigError` naming the setting as a flag (``grad-accum``)
and what it accepts. ``check_model_overrides`` checks ``--model-override`` against the preset.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from minifloat.errors import first_line
from minifloat.train.config_types import check_setting_type
from minifloat.train.errors import ConfigError

if TYPE_CHECKING:
    from minifloat.train.config import TrainConfig

__all__ = ["CHOICES", "check_config", "check_model_overrides"]

CHOICES: dict[str, tuple[str, ...]] = {
    "parallel": ("none", "ddp", "fsdp"),
    "grad_comm": ("fp32", "bf16", "fp8"),
    "tokenizer": ("bpe", "byte"),
    "checkpoint_format": ("full", "sharded"),
}


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _check_sizes(cfg: TrainConfig) -> None:
    if cfg.data_max_bytes is not None and cfg.data_max_bytes < 0:
        raise ConfigError("data-max-bytes must be >= 0 (0: no cap)")
    for name in ("steps", "tokens", "batch_size", "seq_len", "vocab_size"):
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{_flag(name)} must be positive, got {value}")
    if cfg.steps is not None and cfg.tokens is not None:
        raise ConfigError("give either steps or tokens, not both")
    for name in ("grad_accum", "log_every"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{_flag(name)} must be at least 1")
    for name in ("eval_every", "eval_batches", "ckpt_every", "spike_warmup", "sqnr_every"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{_flag(name)} must be >= 0")
    if cfg.stop_after is not None and cfg.stop_after < 1:
        raise ConfigError("stop-after must be at least 1")


def _check_optimizer(cfg: TrainConfig) -> None:
    if cfg.lr is not None and not cfg.lr > 0:
        raise ConfigError(f"lr must be positive, got {cfg.lr}")
    if not 0.0 <= cfg.warmup_fraction < 1.0:
        raise ConfigError("warmup-fraction must be in [0, 1)")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise ConfigError("min-lr-ratio must be in [0, 1]")
    if cfg.weight_decay < 0 or cfg.grad_clip < 0:
        raise ConfigError("z-loss, weight-decay and grad-clip must be >= 0")
    if len(cfg.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.betas):
        raise ConfigError(f"betas must be two numbers in [0, 1), got {cfg.betas}")


def _check_stability(cfg: TrainConfig) -> None:
    if not 0.0 < cfg.embed_grad_shrink <= 1.0:
        raise ConfigError("embed-grad-shrink must be in (0, 1] (1 disables it)")
    if cfg.z_loss < 0:
        raise ConfigError("z-loss, weight-decay and grad-clip must be >= 0")
    if cfg.spike_k < 0 or cfg.grad_norm_spike_k < 0:
        raise ConfigError("spike-k and grad-norm-spike-k must be >= 0 (0: off)")


def _check_choices(cfg: TrainConfig) -> None:
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise ConfigError(
                f"{_flag(name)} must be one of {', '.join(allowed)}, got {getattr(cfg, name)!r}"
            )
    if cfg.sqnr_every and cfg.parallel == "fsdp":
        raise ConfigError("sqnr-every needs whole layers on rank 0; use parallel=ddp or none")
    if cfg.checkpoint_format == "sharded" and cfg.parallel != "fsdp":
        raise ConfigError(
            "checkpoint-format sharded needs parallel=fsdp (other runs hold the whole "
            "model on every rank: use the full format)"
        )


def check_config(cfg: TrainConfig) -> None:
    """Raise :class:`ConfigError` for the first value of ``cfg`` that cannot work."""
    _check_sizes(cfg)
    _check_optimizer(cfg)
    _check_stability(cfg)
    _check_choices(cfg)


def check_model_overrides(model: str, overrides: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigError` unless preset ``model`` accepts ``overrides``.

    Checks each key is a ``LlamaConfig`` field and each value has its type, then builds the
    config so shape rules (e.g. ``dim`` divisible by ``n_heads``) fail here, before any data work.
    """
    from minifloat.models.llama import LlamaConfig, get_config

    hints = typing.get_type_hints(LlamaConfig)
    valid = [f.name for f in dataclasses.fields(LlamaConfig)]
    for key, value in overrides.items():
        if key not in valid:
            raise ConfigError(f"unknown model override {key!r}; valid keys: {', '.join(valid)}")
        check_setting_type(f"model override {key}", value, hints[key])
    try:
        get_config(model, **overrides)
    except (TypeError, ValueError) as exc:
        reason = first_line(exc)
        raise ConfigError(f"model {model!r} does not accept these overrides: {reason}") from None
