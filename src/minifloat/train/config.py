"""TrainConfig: every setting of a training run, as one frozen dataclass.

Fields left as None take a per-model default from :data:`MODEL_DEFAULTS` (the ``tiny`` model is
meant for CPU demos and tests and gets a small batch and a higher learning rate; every other
preset follows the FP4 paper's setup: peak LR 3e-4). :meth:`TrainConfig.resolved` fills them in.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from minifloat.train.config_checks import (
    CHOICES,
    check_config,
    check_model_overrides,
    normalize_model_overrides,
)
from minifloat.train.config_types import check_setting_type
from minifloat.train.errors import ConfigError

__all__ = [
    "CHOICES",
    "ConfigError",
    "MODEL_DEFAULTS",
    "TrainConfig",
    "check_model_overrides",
    "check_setting_type",
    "current_settings",
]


# Defaults that depend on the model size. "tiny" is sized so `make demo` (three recipes x 150
# steps, including tokenizer training) finishes in about three minutes on a 2-core CPU.
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny": {
        "batch_size": 8,
        "seq_len": 128,
        "lr": 1e-3,
        "vocab_size": 2048,
        "data_max_bytes": 4_000_000,
    },
    "default": {
        "batch_size": 16,
        "seq_len": 1024,
        "lr": 3e-4,
        "vocab_size": 8192,
        "data_max_bytes": 0,
    },
}


# Settings that name files or directories: a pathlib.Path is taken as its string.
_PATH_FIELDS = frozenset({"data", "cache_dir", "out_dir", "branch_from"})


@functools.cache
def _field_types() -> dict[str, Any]:
    """Each TrainConfig field's type annotation (resolved once)."""
    return typing.get_type_hints(TrainConfig)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Settings of one training run; see docs/training.md for the meaning of each.

    ``batch_size`` is the per-rank micro-batch: one optimizer step sees
    ``batch_size * grad_accum * world_size`` sequences of ``seq_len`` tokens. Give either
    ``steps`` or ``tokens`` (total training tokens; converted to steps), or neither for the
    default of 200 steps.
    """

    # What to train.
    recipe: str = "bf16"
    # Final-phase precision switch (switch.py): after switch_at (a fraction in (0, 1) of the
    # steps, or a whole step number) the quantized layers change to switch_recipe in place.
    switch_recipe: str | None = None
    switch_at: float | None = None
    # Start a switched run from its plain run's checkpoint at (or before) the switch step
    # instead of step 0: that run's directory or one of its checkpoints (branch.py).
    branch_from: str | None = None
    model: str = "tiny"
    model_overrides: Mapping[str, Any] = field(default_factory=dict)
    data: str = "stdlib"
    tokenizer: str = "bpe"
    vocab_size: int | None = None
    data_max_bytes: int | None = None  # 0: whole corpus
    cache_dir: str | None = None
    # How long and how big.
    steps: int | None = None
    tokens: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    grad_accum: int = 1
    # Optimizer and schedule (AdamW; warm-up then cosine to min_lr_ratio * lr).
    lr: float | None = None
    min_lr_ratio: float = 0.1
    warmup_fraction: float = 0.05
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    optim_states: str = "fp32"
    # Stability.
    z_loss: float = 0.0
    loss_chunk: int = 0  # N > 0: the head and the loss N tokens at a time (head_loss.py)
    embed_grad_shrink: float = 1.0
    spike_k: float = 6.0
    grad_norm_spike_k: float = 0.0  # 0: off (StepGuardConfig explains why that is the default)
    spike_warmup: int = 20
    # Execution.
    seed: int = 0
    device: str = "auto"
    compile: bool = False
    compile_mode: str = "default"  # torch.compile's mode; "reduce-overhead" = CUDA graphs
    # With compile: "block" (each repeated block compiled, one graph for all) or "model" (one
    # graph of the whole model); None: "block" (see compiled_scope).
    compile_scope: str | None = None
    size_rule: str = ""  # "IN:OUT[,...]": layers this small stay in bf16 (size_rule.py); "": none
    parallel: str = "none"
    grad_comm: str = "fp32"
    quantized_all_gather: bool = False  # FSDP: all-gather QuantLinear weights quantized
    # Evaluation, logging, checkpoints.
    eval_every: int = 50
    eval_batches: int = 4  # 0: no validation at all (not even at the end)
    log_every: int = 10
    sqnr_every: int = 0  # per-layer quantization SQNR every N steps (0: off; diagnostics.py)
    # Checkpoints every N steps (0: only at the end, at --stop-after and on SIGINT/SIGTERM); 500
    # is torchtitan's default interval.
    ckpt_every: int = 500
    keep_checkpoints: int = 2  # the newest N; resume falls back to an older one if one is damaged
    # Checkpoint also after these steps, each a whole step number or a fraction of the steps
    # counted as switch_at is: a plain run that switched runs will branch from (compare.py).
    ckpt_at: tuple[float, ...] = ()
    # "full": one file gathered to rank 0; "sharded" (FSDP only): one shard per rank, in a
    # directory (sharded_checkpoint.py), for models whose full state is too big to gather.
    checkpoint_format: str = "full"
    save_checkpoints: bool = True
    out_dir: str = "runs/train"
    resume: bool = False
    overwrite: bool = False  # a new run may replace the run already in out_dir
    stop_after: int | None = None
    # Fail the run (after its last checkpoint) when more than this fraction of its steps were
    # skipped: such a run made no progress, whatever its exit status would otherwise say.
    max_skip_fraction: float = 0.5
    # Refuse (skip and count) an update that makes any weight non-finite; costs one copy of the
    # weights and optimizer state per step (trainer.py, WeightGuard).
    weight_guard: bool = True

    def __post_init__(self) -> None:
        # Every value is checked against its field's type first, as from_dict does for TOML:
        # from Python, steps=2.5 used to run (and skip its logging and checkpoint) and
        # steps="3" to fail inside a comparison with a bare TypeError.
        for name, annotation in _field_types().items():
            value = getattr(self, name)
            if isinstance(value, os.PathLike) and name in _PATH_FIELDS:
                value = os.fspath(value)
            object.__setattr__(
                self, name, check_setting_type(name.replace("_", "-"), value, annotation)
            )
        # (The type check made betas and ckpt_at tuples of floats and switch_at a float: one
        # fingerprint whether a step was written 900 or 900.0.)
        overrides = normalize_model_overrides(self.model_overrides)
        object.__setattr__(self, "model_overrides", overrides)
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` for values that cannot work (config_checks.py)."""
        check_config(self)

    def resolved(self) -> TrainConfig:
        """A copy with every None default filled in from :data:`MODEL_DEFAULTS`."""
        return dataclasses.replace(self, **self._defaults_for_none())

    def _defaults_for_none(self) -> dict[str, Any]:
        """The :data:`MODEL_DEFAULTS` values of the fields left None (no copy, no validation)."""
        defaults = MODEL_DEFAULTS.get(self.model, MODEL_DEFAULTS["default"])
        return {k: v for k, v in defaults.items() if getattr(self, k) is None}

    @property
    def compiled_scope(self) -> str | None:
        """What ``torch.compile`` wraps: None (not compiled), "block" or "model".

        Per block by default: identical blocks share one graph, so compiling takes one block's
        time. A 125M run on an H200 took its first step after 18 s per block against 128 s as
        one graph; per block it finished 30 steps and two validations in 47 s, where one graph
        was still compiling its validation graph after 175 s; at 1.3B, 20 s per block, and no
        step in 180 s as one graph (session 57). One graph ran the 125M steps ~11 % faster
        (48 against 54 ms).
        """
        if not self.compile:
            return None
        return self.compile_scope or "block"

    def total_steps(self, world_size: int = 1) -> int:
        """Optimizer steps of the run (from ``steps``, ``tokens`` or the default of 200)."""
        if self.steps is not None:
            return self.steps
        if self.tokens is None:
            return 200
        # the defaults looked up, not `resolved()`: validation calls this, and resolved()
        # validates the copy it makes
        filled = self._defaults_for_none()
        batch = filled.get("batch_size", self.batch_size)
        seq = filled.get("seq_len", self.seq_len)
        per_step = batch * seq * self.grad_accum * world_size
        return max(1, math.ceil(self.tokens / per_step))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable form (for checkpoints and logs)."""
        out = dataclasses.asdict(self)
        out["betas"] = list(self.betas)
        out["ckpt_at"] = list(self.ckpt_at)
        return out

    @classmethod
    def typed_values(cls, values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` keyed by field name ('-' becomes '_'), each converted to its field's type
        (integral floats such as TOML's ``2e9`` count as integers, integers as floats).

        Raises :class:`ConfigError` for an unknown key (with the closest setting's name) or a
        value of the wrong type, naming the setting and the expected type.
        """
        hints = _field_types()
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in hints:
                close = difflib.get_close_matches(name, sorted(hints), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"unknown setting {key!r}{hint}")
            kwargs[name] = check_setting_type(name.replace("_", "-"), value, hints[name])
        return kwargs

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainConfig:
        """Build from a mapping (e.g. a TOML table); keys may use '-' or '_' (`typed_values`)."""
        kwargs = cls.typed_values(values)
        if "model_overrides" in kwargs:
            overrides = kwargs["model_overrides"]
            kwargs["model_overrides"] = {k.replace("-", "_"): v for k, v in overrides.items()}
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise ConfigError(str(exc)) from None

    def trajectory_fields(self, world_size: int) -> dict[str, Any]:
        """Settings that determine the training trajectory (a checkpoint's fingerprint).

        Output paths, logging/eval/diagnostic cadence, device, compile, checkpoint format and
        stop_after are left out: they do not change which update is applied at which step;
        nor does ``branch_from`` (a branched run continues exactly as the run would have).
        """
        cfg = self.resolved()
        skip = {
            "out_dir", "resume", "eval_every", "eval_batches", "log_every", "ckpt_every",
            "save_checkpoints", "stop_after", "device", "compile", "cache_dir", "steps", "tokens",
            "sqnr_every", "checkpoint_format", "keep_checkpoints", "overwrite", "max_skip_fraction",
            "weight_guard", "quantized_all_gather", "compile_mode", "compile_scope", "branch_from",
            "ckpt_at",
        }  # fmt: skip
        # A setting added later enters only when it is on, so the fingerprints of checkpoints
        # written before it existed stay valid.
        if not cfg.grad_norm_spike_k:
            skip.add("grad_norm_spike_k")
        if not cfg.size_rule:
            skip.add("size_rule")
        if not cfg.loss_chunk:
            skip.add("loss_chunk")
        if cfg.switch_recipe is None and cfg.switch_at is None:
            skip.update(("switch_recipe", "switch_at"))
        fields = {k: v for k, v in cfg.to_dict().items() if k not in skip}
        fields["total_steps"] = cfg.total_steps(world_size)
        fields["world_size"] = world_size
        return fields


def current_settings(stored: Mapping[str, Any]) -> dict[str, Any]:
    """Settings a checkpoint stored (``TrainConfig.to_dict()``), in today's form.

    Before session 57 every run stored ``compile_scope="model"``, then the default, compiled or
    not; a config now refuses a scope without ``compile``. Uncompiled, the scope never mattered.
    """
    values = dict(stored)
    if not values.get("compile") and values.get("compile_scope") == "model":
        values["compile_scope"] = None
    return values
