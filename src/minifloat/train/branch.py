"""Branching a switched run from its plain run, so it trains only the steps after the switch.

A run with a final-phase switch (switch.py), say ``fp4+switch=bf16+at=0.9``, computes exactly as
the plain ``fp4`` run of the same settings up to its switch step S: same recipe, weights,
batches, RNG draws. ``TrainConfig(branch_from=SOURCE)`` (``minifloat train --branch-from``) starts
it from the plain run's checkpoint at a step k <= S instead of from step 0, and it then ends
bit for bit as if it had trained from scratch (tests/train/test_branch.py). ``SOURCE`` is the
plain run's directory (its newest checkpoint at or before S, of either format) or one of its
checkpoints (a file, or a sharded ``.dcp`` directory).

* **Matched**: the source checkpoint's fingerprint must equal this run's with the switch settings
  removed (:func:`source_fields`), else a one-line :class:`ConfigError` names the differing
  settings. That is checked, and the checkpoint chosen, before the run directory is touched.
* **Read only**: nothing in the source is written, locked or removed; a damaged candidate is
  passed over (with a warning) for the next older one at or before S, and left as it is.
* **Whole curves**: the branched run's ``metrics.jsonl`` starts with the source's records up to
  k and a record ``{"step": k, "branched_from": DIR, "branch_step": k}``; its checkpoints and
  :class:`~minifloat.train.result.TrainResult` say where it branched from (``branched_from``,
  ``branch_step``), also after a resume. The run writes its own checkpoint at k at once, so it
  resumes (``--resume``) from its own directory from then on.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minifloat.errors import first_line
from minifloat.train.checkpointer import (
    Checkpointer,
    checkpoint_candidates,
    read_checkpoint_summary,
)
from minifloat.train.config import TrainConfig
from minifloat.train.errors import (
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
    RunWarning,
)
from minifloat.train.integrity import describe_mismatch
from minifloat.train.metrics import copy_records
from minifloat.train.run_dir import METRICS_NAME
from minifloat.train.runtime import Runtime, broadcast_object
from minifloat.train.switch import step_at, switch_step

# Fingerprinted facts the trainer adds to the settings once data and model exist
# (Trainer._run_facts): compared when the checkpoint is loaded, not when it is chosen.
RUN_FACTS = ("corpus_sha256", "num_params")

__all__ = [
    "RUN_FACTS",
    "BranchPoint",
    "checkpoint_steps",
    "find_branch_point",
    "load_branch",
    "plan_branch",
    "source_fields",
]


@dataclass(frozen=True, kw_only=True)
class BranchPoint:
    """Where a run branches: the source run's directory, the settings its checkpoint must have
    been written with, and its readable checkpoints at or before the switch (newest first)."""

    run_dir: Path
    fields: dict[str, Any]
    candidates: tuple[tuple[Path, int], ...]

    def info(self, step: int) -> dict[str, Any]:
        """What the branched run records about its start (checkpoint state, metrics)."""
        return {"from": str(self.run_dir), "step": step}

    def write_metrics(self, out_dir: Path, step: int) -> None:
        """``out_dir``'s metrics file: the source's records up to ``step``, then a record that
        says the run was branched there."""
        marker = {"step": step, "branched_from": str(self.run_dir), "branch_step": step}
        copy_records(self.run_dir / METRICS_NAME, out_dir / METRICS_NAME, until=step,
                     extra=marker)  # fmt: skip


def source_fields(config: TrainConfig, world_size: int) -> dict[str, Any]:
    """The trajectory settings of the plain run ``config`` branches from: its own without the
    switch (the fingerprint a checkpoint of that run holds)."""
    plain = dataclasses.replace(config, switch_recipe=None, switch_at=None, branch_from=None)
    return plain.trajectory_fields(world_size)


def checkpoint_steps(points: tuple[float, ...], total_steps: int) -> frozenset[int]:
    """The steps ``ckpt_at`` names (fractions counted as switch-at counts them), where a plain
    run checkpoints so that its switched runs can branch there exactly; a step beyond the run
    raises :class:`ConfigError`."""
    steps = {step_at(point, total_steps) for point in points}
    outside = sorted(s for s in steps if not 1 <= s <= total_steps)
    if outside:
        raise ConfigError(f"ckpt-at step {outside[0]} is outside the run ({total_steps} steps)")
    return frozenset(steps)


def _is_one_checkpoint(path: Path) -> bool:
    """A checkpoint file or sharded checkpoint directory, not a run directory."""
    return path.is_file() or path.suffix == ".dcp"


def _readable(paths: list[Path], source: Path) -> list[tuple[Path, dict[str, Any]]]:
    """(path, summary) of the checkpoints among ``paths`` whose small parts read; the others
    are passed over with a warning (left as they are), unless none reads."""
    found, errors = [], []
    for path in paths:
        try:
            found.append((path, read_checkpoint_summary(path)))
        except CheckpointError as exc:
            errors.append(exc)
    if not found and errors:
        raise errors[0]
    for exc in errors:
        warnings.warn(f"branch-from {source}: passed over ({first_line(exc)})", RunWarning,
                      stacklevel=3)  # fmt: skip
    return found


def find_branch_point(config: TrainConfig, world_size: int) -> BranchPoint:
    """Choose where ``config`` (a switched run with ``branch_from``) starts; raise a one-line
    :class:`ConfigError` when the source cannot serve (another run, no checkpoint at or before
    the switch), :class:`CheckpointError` when its checkpoints are unreadable. Reads only."""
    assert config.branch_from is not None and config.switch_at is not None  # check_config
    source = Path(config.branch_from)
    step = switch_step(config.switch_at, config.total_steps(world_size))
    if not source.exists():
        raise ConfigError(f"branch-from {source}: no such run directory or checkpoint")
    if source.resolve() == Path(config.out_dir).resolve():
        raise ConfigError(f"branch-from {source} is this run's own --out; give the plain run's")
    one = _is_one_checkpoint(source)
    paths = [source] if one else [p for f in ("full", "sharded") for p in
                                  checkpoint_candidates(source, f)]  # fmt: skip
    if not paths:
        raise ConfigError(
            f"branch-from {source}: no checkpoint there (looked for checkpoint.pt and "
            "checkpoint.dcp)"
        )
    found = sorted(_readable(paths, source), key=lambda item: -int(item[1]["step"]))
    fields = source_fields(config, world_size)
    newest, summary = found[0]
    saved = {k: v for k, v in summary["fields"].items() if k not in RUN_FACTS}
    if saved != json.loads(json.dumps(fields, default=str)):
        raise ConfigError(
            f"branch-from {newest} was written by a run that differs from this one in more "
            f"than the switch ({describe_mismatch(saved, fields)})"
        )
    early = tuple((p, int(s["step"])) for p, s in found if int(s["step"]) <= step)
    if not early and one:
        raise ConfigError(
            f"branch-from {source}: its step {summary['step']} is after the switch step "
            f"{step}; a branch starts at or before the switch"
        )
    if not early:
        steps = ", ".join(str(s["step"]) for _, s in found)
        raise ConfigError(
            f"branch-from {source}: no checkpoint at or before the switch step {step} (its "
            f"checkpoints are at steps {steps}); checkpoint the plain run at that step, e.g. "
            f"with --stop-after {step}"
        )
    run_dir = source.parent if one else source
    return BranchPoint(run_dir=run_dir, fields=fields, candidates=early)


def plan_branch(config: TrainConfig, runtime: Runtime) -> BranchPoint | None:
    """:func:`find_branch_point` on rank 0, its answer (or error) on every rank; None when the
    run does not branch."""
    if config.branch_from is None:
        return None
    point, error = None, None
    if runtime.is_main:
        try:
            point = find_branch_point(config, runtime.world_size)
        except (ConfigError, CheckpointError) as exc:
            error = exc
    point, error = broadcast_object((point, error), runtime)
    if error is not None:
        raise error
    return point


def load_branch(
    point: BranchPoint,
    checkpointer: Checkpointer,
    *,
    facts: dict[str, Any],
    before_model: Callable[[int], None],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global state, this rank's state) of the newest intact candidate of ``point``, model
    and optimizer loaded through ``checkpointer``; a damaged one is passed over, not removed.
    ``facts``: this run's :data:`RUN_FACTS`, which the checkpoint must hold too."""
    fields = {**point.fields, **facts}
    damaged: list[tuple[Path, CheckpointError]] = []
    for path, step in point.candidates:
        try:
            state, local = checkpointer.load_from(path, fields=fields,
                                                  before_model=before_model)  # fmt: skip
        except CheckpointMismatchError as exc:
            raise ConfigError(f"branch-from: {first_line(exc)}") from None
        except CheckpointError as exc:
            damaged.append((path, exc))
            continue
        if int(state["step"]) != step:  # replaced while this run chose it
            raise CheckpointError(f"branch-from: {path} changed while it was read; try again")
        if damaged and checkpointer.runtime.is_main:
            reasons = "; ".join(f"{p.name}: {first_line(e)}" for p, e in damaged)
            warnings.warn(f"branching from {path} (step {step}): newer checkpoints are damaged "
                          f"({reasons})", RunWarning, stacklevel=3)  # fmt: skip
        return state, local
    raise damaged[0][1]
