"""Where a run keeps its checkpoints, in either format, and what a stored run says about itself.

A run directory holds ``checkpoint.pt`` (the full format, :mod:`minifloat.train.checkpoint`) or
``checkpoint.dcp/`` (the sharded format, :mod:`minifloat.train.sharded_checkpoint`), the newest,
and up to ``keep_checkpoints - 1`` older ones (``checkpoint.1.pt``, ...; slots.py). This module
knows both formats; the two format modules know only :mod:`minifloat.train.integrity`.
:class:`Checkpointer` saves and loads the model and optimizer of a run together with the rest of
its state, which the trainer hands over as plain dictionaries. Loading falls back, with a
warning, to the next older checkpoint when one is damaged (unreadable, truncated, corrupt); one
written by a different run is an error, never a reason to fall back.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minifloat.errors import first_line
from minifloat.train.checkpoint import (
    load_checkpoint,
    read_checkpoint_config,
    read_checkpoint_header,
    save_checkpoint,
)
from minifloat.train.config import current_settings
from minifloat.train.errors import (
    CheckpointError,
    CheckpointMismatchError,
    RunFailed,
    RunWarning,
)
from minifloat.train.runtime import Runtime, all_gather_objects, broadcast_object
from minifloat.train.sharded_checkpoint import (
    load_sharded,
    old_dir,
    read_manifest,
    read_sharded_config,
    save_sharded,
)
from minifloat.train.slots import existing_slots, rotate
from minifloat.train.state import full_state, load_full_state

__all__ = [
    "CHECKPOINT_NAME",
    "SHARDED_CHECKPOINT_NAME",
    "Checkpointer",
    "checkpoint_candidates",
    "is_sharded",
    "read_checkpoint_summary",
    "read_run_config",
    "read_stored_config",
]

CHECKPOINT_NAME = "checkpoint.pt"
SHARDED_CHECKPOINT_NAME = "checkpoint.dcp"  # a directory (checkpoint_format="sharded")


def read_stored_config(path: str | os.PathLike) -> dict[str, Any]:
    """The run settings (``TrainConfig.to_dict()``) saved in the checkpoint at ``path``.

    ``path`` is a full checkpoint file or a sharded checkpoint directory. Only the small parts
    are read (tensors stay memory-mapped) and the digest is not checked here: resuming loads
    and verifies the whole checkpoint anyway. Raises :class:`CheckpointError`.
    """
    path = Path(path)
    config = read_sharded_config(path) if is_sharded(path) else read_checkpoint_config(path)
    if not isinstance(config, dict):
        raise CheckpointError(f"checkpoint {path} holds no run settings")
    return current_settings(config)


def is_sharded(path: Path) -> bool:
    """Whether ``path`` names a sharded checkpoint (a ``.dcp`` directory) and not a file."""
    return path.suffix == ".dcp" or path.is_dir()


def read_checkpoint_summary(path: str | os.PathLike) -> dict[str, Any]:
    """``{"step", "fields", "fingerprint"}`` of the checkpoint at ``path`` (either format),
    from its small parts only, the content digest not checked: to choose a checkpoint and
    compare its settings before loading it. Raises :class:`CheckpointError`."""
    path = Path(path)
    if not is_sharded(path):
        return read_checkpoint_header(path)
    manifest = read_manifest(path)
    keys = ("step", "fields", "fingerprint")
    return {key: manifest[key] for key in keys}


def checkpoint_candidates(out_dir: Path, fmt: str) -> list[Path]:
    """The checkpoints of format ``fmt`` ("full" or "sharded") in ``out_dir``, newest first.

    A sharded save that crashed between its two renames left only ``.checkpoint.dcp.old``; the
    newest name stands for it then (the sharded loader resolves it).
    """
    sharded = fmt == "sharded"
    newest = Path(out_dir) / (SHARDED_CHECKPOINT_NAME if sharded else CHECKPOINT_NAME)
    found = existing_slots(newest)
    if sharded and newest not in found and old_dir(newest).is_dir():
        found.insert(0, newest)
    return found


def require_checkpoint(out_dir: Path, formats: tuple[str, ...], setting: str, advice: str) -> None:
    """Raise :class:`CheckpointError` "SETTING: no checkpoint in DIR (looked for ...); ADVICE"
    unless ``out_dir`` holds a checkpoint of one of ``formats``: a resume without one stops
    before any data is read or model built."""
    if not any(checkpoint_candidates(out_dir, f) for f in formats):
        names = {"full": CHECKPOINT_NAME, "sharded": SHARDED_CHECKPOINT_NAME}
        looked = " and ".join(names[f] for f in formats)
        raise CheckpointError(
            f"{setting}: no checkpoint in {out_dir} (looked for {looked}); {advice}"
        )


def read_run_config(out_dir: Path, formats: tuple[str, ...]) -> tuple[Path, dict[str, Any]]:
    """(checkpoint, its stored settings) of the newest readable checkpoint in ``out_dir`` among
    ``formats``; raises the newest one's :class:`CheckpointError` when none is readable, and
    one naming where it looked when there is none."""
    paths = [p for fmt in formats for p in checkpoint_candidates(out_dir, fmt)]
    errors: list[CheckpointError] = []
    for path in paths:
        try:
            return path, read_stored_config(path)
        except CheckpointError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
    names = {"full": CHECKPOINT_NAME, "sharded": SHARDED_CHECKPOINT_NAME}
    looked = " and ".join(names[f] for f in formats)
    raise CheckpointError(f"no checkpoint in {out_dir} (looked for {looked})")


class Checkpointer:
    """Saves and loads one run's checkpoints in ``out_dir``, keeping the newest ``keep``.

    ``fmt`` is "full" (gathered to rank 0, one file) or "sharded" (one shard per rank, FSDP);
    ``fields`` are the trajectory settings a checkpoint must match to be resumed.
    """

    def __init__(
        self,
        out_dir: Path,
        *,
        fmt: str,
        keep: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        runtime: Runtime,
        fsdp: bool,
        fields: Mapping[str, Any],
    ) -> None:
        self.out_dir, self.fmt, self.keep = Path(out_dir), fmt, keep
        self.sharded = fmt == "sharded"
        self.model, self.optimizer = model, optimizer
        self.runtime, self.fsdp, self.fields = runtime, fsdp, dict(fields)

    @property
    def path(self) -> Path:
        """Where the newest checkpoint is (or will be) written."""
        return self.out_dir / (SHARDED_CHECKPOINT_NAME if self.sharded else CHECKPOINT_NAME)

    def save(self, global_state: Mapping[str, Any], rank_state: Mapping[str, Any]) -> Path | None:
        """Write a checkpoint; every rank takes part. ``global_state`` is the same on every
        rank, ``rank_state`` is this rank's own. Returns the path (None on ranks that do not
        write in the full format).

        A save that fails (disk full, quota, permissions) leaves every earlier checkpoint as it
        was and raises :class:`RunFailed` naming the newest one, on every rank."""
        failure, error, path = None, None, None
        try:
            path = self._write(global_state, rank_state)
        except Exception as exc:  # any failure of the write (disk full, ...) stops the run
            error = exc
            failure = (
                f"could not write the checkpoint of step {global_state['step']} to {self.path} "
                f"({first_line(exc)}); {self.resume_hint()} once the cause is fixed"
            )
        if not self.sharded:  # only rank 0 wrote: every rank learns how that went
            failure = broadcast_object(failure, self.runtime)
        if failure is not None:
            raise RunFailed(failure) from error
        return path

    def _write(self, global_state: Mapping[str, Any], rank_state: Mapping[str, Any]) -> Path | None:
        if self.sharded:
            return save_sharded(self.path, model=self.model, optimizer=self.optimizer,
                                global_state=global_state, rank_state=rank_state,
                                fields=self.fields, keep=self.keep)  # fmt: skip
        state = dict(global_state)
        state["model"], state["optimizer"] = full_state(self.model, self.optimizer,
                                                        fsdp=self.fsdp)  # fmt: skip
        state["ranks"] = all_gather_objects(dict(rank_state), self.runtime)
        if not self.runtime.is_main:
            return None
        # The older checkpoints move down a slot only once the new one is complete on disk.
        return save_checkpoint(self.path, state, fields=self.fields,
                               before_replace=lambda: rotate(self.path, self.keep))  # fmt: skip

    def newest(self) -> tuple[Path, int] | None:
        """(path, step) of this run's newest readable checkpoint; None when it has none."""
        for path in checkpoint_candidates(self.out_dir, self.fmt):
            try:
                return path, int(read_checkpoint_summary(path)["step"])
            except CheckpointError:
                continue
        return None

    def describe_newest(self) -> tuple[str, Path | None]:
        """("newest checkpoint DIR/checkpoint.pt (step 500)" or "this run has no checkpoint
        yet", its path or None), for messages."""
        newest = self.newest()
        if newest is None:
            return "this run has no checkpoint yet", None
        return f"newest checkpoint {newest[0]} (step {newest[1]})", newest[0]

    def resume_hint(self) -> str:
        """Where this run can be continued from, for a message: "newest checkpoint
        DIR/checkpoint.pt (step 500); continue with --resume"."""
        where, path = self.describe_newest()
        return f"{where}; {'continue with --resume' if path else 'start it again'}"

    def load(
        self, *, before_model: Callable[[int], None] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(global state, this rank's state) of the newest intact checkpoint; model and
        optimizer loaded. Raises :class:`CheckpointError` when there is none, or the newest
        one's error when every one is damaged; a checkpoint of a different run raises
        :class:`CheckpointMismatchError` at once.

        ``before_model(step)`` is called with a checkpoint's step once it is verified, before
        its model state is loaded: to give the model the structure it had at that step (a
        precision switch changes the fp8-delayed amax buffers, switch.py).
        """
        candidates = checkpoint_candidates(self.out_dir, self.fmt)
        if not candidates:
            raise CheckpointError(f"no checkpoint at {self.path}")
        damaged: list[tuple[Path, CheckpointError]] = []
        for path in candidates:
            try:
                loaded = self.load_from(path, before_model=before_model)
            except CheckpointMismatchError:
                raise
            except CheckpointError as exc:
                damaged.append((path, exc))
                continue
            if damaged:
                self._fell_back(path, int(loaded[0]["step"]), damaged)
            return loaded
        raise damaged[0][1]

    def load_from(
        self,
        path: Path,
        *,
        fields: Mapping[str, Any] | None = None,
        before_model: Callable[[int], None] | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(global state, this rank's state) of the checkpoint at ``path``, in either format,
        model and optimizer loaded; no fallback. ``fields``: the settings it must have been
        written with (default: this run's; a branch passes its source run's, branch.py)."""
        fields = self.fields if fields is None else dict(fields)
        if is_sharded(path):
            return load_sharded(path, model=self.model, optimizer=self.optimizer,
                                fields=fields, before_model=before_model)  # fmt: skip
        state = load_checkpoint(path, fields=fields)
        if before_model is not None:
            before_model(int(state["step"]))
        load_full_state(self.model, self.optimizer, state.pop("model"), state.pop("optimizer"),
                        fsdp=self.fsdp)  # fmt: skip
        return state, state["ranks"][self.runtime.rank]

    def _fell_back(self, used: Path, step: int, damaged: list[tuple[Path, Exception]]) -> None:
        """Warn, and delete the damaged newer checkpoints: the resumed run recomputes the steps
        they held, and a damaged file left in a slot would be a fallback that cannot work."""
        if not self.runtime.is_main:
            return
        reasons = "; ".join(f"{p.name}: {first_line(e)}" for p, e in damaged)
        warnings.warn(
            f"resuming from {used} (step {step}): newer checkpoints are damaged and were "
            f"removed ({reasons})",
            RunWarning,
            stacklevel=3,
        )
        for path, _ in damaged:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
