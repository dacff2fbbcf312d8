"""The value rules of a :class:`~minifloat.train.config.TrainConfig`, one group per function.

Each rule raises a one-line :class:`ConfigError` naming the setting as a flag (``grad-accum``)
and what it accepts. ``check_model_overrides`` checks ``--model-override`` against the preset.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from minifloat.errors import first_line
from minifloat.train.config_types import check_setting_type
from minifloat.train.errors import ConfigError
from minifloat.train.switch import check_switch_at, switch_step

if TYPE_CHECKING:
    from minifloat.train.config import TrainConfig

__all__ = ["CHOICES", "check_config", "check_model_overrides", "normalize_model_overrides"]

CHOICES: dict[str, tuple[str, ...]] = {
    "parallel": ("none", "ddp", "fsdp"),
    "grad_comm": ("fp32", "bf16", "fp8"),
    "tokenizer": ("bpe", "byte"),
    "checkpoint_format": ("full", "sharded"),
    "compile_mode": ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    "compile_scope": ("model", "block"),
}


MAX_STEPS = 2**40


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
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or not 0 <= cfg.seed < 2**63:
        raise ConfigError(f"seed must be an integer in [0, 2^63), got {cfg.seed!r}")
    for name in ("grad_accum", "log_every"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{_flag(name)} must be at least 1")
    # after grad_accum's check: the step count divides by it
    # More optimizer steps than any run takes: a typo (tokens = 1e40 trained at an LR of 1e-40,
    # its warm-up never ending)
    steps = cfg.total_steps()
    if steps > MAX_STEPS:
        source = (
            "steps" if cfg.steps is not None else f"tokens={cfg.tokens:g} give {steps:.3g} steps"
        )
        raise ConfigError(f"{source}: at most 2^40 optimizer steps")
    for name in ("eval_every", "eval_batches", "ckpt_every", "spike_warmup", "sqnr_every",
                 "loss_chunk"):  # fmt: skip
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{_flag(name)} must be >= 0")
    if cfg.stop_after is not None and cfg.stop_after < 1:
        raise ConfigError("stop-after must be at least 1")


def _number(cfg: TrainConfig, name: str, *, low: float, high: float = math.inf,
            low_open: bool = False, note: str = "") -> None:  # fmt: skip
    """``name`` must be a finite number in [low, high] (or (low, high] when ``low_open``):
    NaN and infinity pass no comparison a rule could make, so they are refused by name."""
    value = getattr(cfg, name)
    above = value > low if low_open else value >= low
    if math.isfinite(value) and above and value <= high:
        return
    if high < math.inf:
        where = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
    else:
        where = ("positive" if low == 0 else f"> {low:g}") if low_open else f">= {low:g}"
    raise ConfigError(f"{_flag(name)} must be {where} and finite{note}, got {value}")


def _check_optimizer(cfg: TrainConfig) -> None:
    if cfg.lr is not None:
        _number(cfg, "lr", low=0.0, low_open=True)
    if not (math.isfinite(cfg.warmup_fraction) and 0.0 <= cfg.warmup_fraction < 1.0):
        raise ConfigError(f"warmup-fraction must be in [0, 1), got {cfg.warmup_fraction}")
    _number(cfg, "min_lr_ratio", low=0.0, high=1.0)
    _number(cfg, "weight_decay", low=0.0)
    _number(cfg, "eps", low=0.0, low_open=True)
    _number(cfg, "grad_clip", low=0.0, note=" (0: off)")
    if len(cfg.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.betas):
        raise ConfigError(f"betas must be two numbers in [0, 1), got {cfg.betas}")
    if cfg.lr is not None and cfg.lr * cfg.weight_decay >= 1.0:
        # Decoupled weight decay multiplies every matrix by (1 - lr * weight_decay) each step.
        raise ConfigError(
            f"lr x weight-decay must be below 1 (AdamW multiplies the weights by "
            f"1 - lr x weight-decay every step), got {cfg.lr} x {cfg.weight_decay}"
        )


def _check_stability(cfg: TrainConfig) -> None:
    _number(cfg, "embed_grad_shrink", low=0.0, high=1.0, low_open=True, note=" (1: off)")
    _number(cfg, "z_loss", low=0.0, note=" (0: off)")
    _number(cfg, "spike_k", low=0.0, note=" (0: off)")
    _number(cfg, "grad_norm_spike_k", low=0.0, note=" (0: off)")
    _number(cfg, "max_skip_fraction", low=0.0, high=1.0)


def _check_checkpoints(cfg: TrainConfig) -> None:
    if not cfg.out_dir.strip():  # "" would write the run's files into the current directory
        raise ConfigError(f"out must name a run directory, got {cfg.out_dir!r}")
    if cfg.keep_checkpoints < 1:
        raise ConfigError(f"keep-checkpoints must be at least 1, got {cfg.keep_checkpoints}")
    if cfg.resume and cfg.overwrite:
        raise ConfigError("give either resume or overwrite, not both")


def _check_choices(cfg: TrainConfig) -> None:
    from minifloat.data.corpora import DataError, check_corpus_name  # the data layer's rule

    try:
        check_corpus_name(cfg.data)  # before the run directory is made
    except DataError as exc:
        raise ConfigError(str(exc)) from None
    for name, allowed in CHOICES.items():  # None: the field's default (compile_scope's)
        if (value := getattr(cfg, name)) is not None and value not in allowed:
            raise ConfigError(f"{_flag(name)} must be one of {', '.join(allowed)}, got {value!r}")
    if cfg.sqnr_every and cfg.parallel == "fsdp":
        raise ConfigError("sqnr-every needs whole layers on rank 0; use parallel=ddp or none")
    if cfg.size_rule:
        from minifloat.size_rule import SizeRule

        try:
            SizeRule.parse(cfg.size_rule)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if cfg.compile_mode != "default" and not cfg.compile:
        raise ConfigError(f"compile-mode {cfg.compile_mode} needs compile (--compile)")
    if cfg.compile_scope is not None and not cfg.compile:
        raise ConfigError(f"compile-scope {cfg.compile_scope} needs compile (--compile)")
    if cfg.quantized_all_gather and cfg.parallel != "fsdp":
        raise ConfigError("quantized-all-gather needs parallel=fsdp")
    if cfg.checkpoint_format == "sharded" and cfg.parallel != "fsdp":
        raise ConfigError(
            "checkpoint-format sharded needs parallel=fsdp (other runs hold the whole "
            "model on every rank: use the full format)"
        )


def _check_switch(cfg: TrainConfig) -> None:
    """The final-phase switch: both settings or neither, another recipe, a switch-at that
    leaves steps on both sides (switch.py; recipe names are checked with the other names)."""
    if cfg.switch_recipe is None and cfg.switch_at is None:
        return
    if cfg.switch_recipe is None:
        raise ConfigError("switch-at needs switch-recipe (the recipe the run switches to)")
    if cfg.switch_at is None:
        raise ConfigError(
            f"switch-recipe {cfg.switch_recipe} needs switch-at (a fraction in (0, 1) of the "
            "steps, or the step after which it takes over)"
        )
    if cfg.switch_recipe == cfg.recipe:
        raise ConfigError(f"switch-recipe {cfg.switch_recipe} is the run's recipe already")
    check_switch_at(cfg.switch_at)
    if cfg.steps is not None:  # else the steps come from tokens and the world size (trainer)
        switch_step(cfg.switch_at, cfg.steps)


def _check_branch(cfg: TrainConfig) -> None:
    """branch-from: only for a switched run that starts (branch.py); ckpt-at: points in a run."""
    if not isinstance(cfg.ckpt_at, tuple):
        raise ConfigError(f"ckpt-at must be a list of numbers, got {cfg.ckpt_at!r}")
    for point in cfg.ckpt_at:
        check_switch_at(point, name="ckpt-at")
    if cfg.branch_from is None:
        return
    if cfg.switch_recipe is None:
        raise ConfigError(
            "branch-from needs switch-recipe and switch-at: a switched run branches from its "
            "plain run at the switch step"
        )
    if cfg.resume:
        raise ConfigError(
            "give either resume or branch-from, not both (a branched run continues with resume)"
        )


def check_config(cfg: TrainConfig) -> None:
    """Raise :class:`ConfigError` for the first value of ``cfg`` that cannot work."""
    _check_sizes(cfg)
    _check_optimizer(cfg)
    _check_stability(cfg)
    _check_checkpoints(cfg)
    _check_choices(cfg)
    _check_switch(cfg)
    _check_branch(cfg)


def normalize_model_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides`` with each value converted to its ``LlamaConfig`` field's type where it
    fits (``dim=1e3`` becomes the integer 1000, as TOML's ``2e9`` does for counts).

    Unknown keys and values of the wrong type are kept as they are, for
    :func:`check_model_overrides` to report.
    """
    from minifloat.models.llama import LlamaConfig

    hints = typing.get_type_hints(LlamaConfig)
    out = dict(overrides)
    for key, value in overrides.items():
        if key in hints:
            with contextlib.suppress(ConfigError):
                out[key] = check_setting_type(key, value, hints[key])
    return out


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
        get_config(model, **normalize_model_overrides(overrides))
    # ArithmeticError: a shape rule that divides by a zero field (n_heads=0) is a bad value too.
    except (TypeError, ValueError, ArithmeticError) as exc:
        reason = first_line(exc)
        raise ConfigError(f"model {model!r} does not accept these overrides: {reason}") from None
