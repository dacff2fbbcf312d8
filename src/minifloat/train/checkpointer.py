"""Where a run keeps its checkpoints, in either format, and what a stored run says about itself.

A run directory holds ``checkpoint.pt`` (the full format, :mod:`minifloat.train.checkpoint`) or
``checkpoint.dcp/`` (the sharded format, :mod:`minifloat.train.sharded_checkpoint`). This module
knows both; the two format modules know only :mod:`minifloat.train.integrity`.
:class:`Checkpointer` saves and loads the model and optimizer of a run together with the rest of
its state, which the trainer hands over as plain dictionaries.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minifloat.train.checkpoint import load_checkpoint, read_checkpoint_config, save_checkpoint
from minifloat.train.integrity import CheckpointError
from minifloat.train.runtime import Runtime, all_gather_objects
from minifloat.train.sharded_checkpoint import load_sharded, read_sharded_config, save_sharded
from minifloat.train.state import full_state, load_full_state

__all__ = ["CHECKPOINT_NAME", "SHARDED_CHECKPOINT_NAME", "Checkpointer", "read_stored_config"]

CHECKPOINT_NAME = "checkpoint.pt"
SHARDED_CHECKPOINT_NAME = "checkpoint.dcp"  # a directory (checkpoint_format="sharded")


def read_stored_config(path: str | os.PathLike) -> dict[str, Any]:
    """The run settings (``TrainConfig.to_dict()``) saved in the checkpoint at ``path``.

    ``path`` is a full checkpoint file or a sharded checkpoint directory. Only the small parts
    are read (tensors stay memory-mapped) and the digest is not checked here: resuming loads
    and verifies the whole checkpoint anyway. Raises :class:`CheckpointError`.
    """
    path = Path(path)
    sharded = path.suffix == ".dcp" or path.is_dir()
    config = read_sharded_config(path) if sharded else read_checkpoint_config(path)
    if not isinstance(config, dict):
        raise CheckpointError(f"checkpoint {path} holds no run settings")
    return dict(config)


class Checkpointer:
    """Saves and loads one run's checkpoints in ``out_dir``.

    ``fmt`` is "full" (gathered to rank 0, one file) or "sharded" (one shard per rank, FSDP);
    ``fields`` are the trajectory settings a checkpoint must match to be resumed.
    """

    def __init__(
        self,
        out_dir: Path,
        *,
        fmt: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        runtime: Runtime,
        fsdp: bool,
        fields: Mapping[str, Any],
    ) -> None:
        self.out_dir = Path(out_dir)
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
        write in the full format)."""
        if self.sharded:
            return save_sharded(self.path, model=self.model, optimizer=self.optimizer,
                                global_state=global_state, rank_state=rank_state,
                                fields=self.fields)  # fmt: skip
        state = dict(global_state)
        state["model"], state["optimizer"] = full_state(self.model, self.optimizer,
                                                        fsdp=self.fsdp)  # fmt: skip
        state["ranks"] = all_gather_objects(dict(rank_state), self.runtime)
        if not self.runtime.is_main:
            return None
        return save_checkpoint(self.path, state, fields=self.fields)

    def load(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(global state, this rank's state) of the checkpoint; model and optimizer loaded.
        Raises :class:`CheckpointError` when it is missing, damaged or of another run."""
        if self.sharded:
            return load_sharded(self.path, model=self.model, optimizer=self.optimizer,
                                fields=self.fields)  # fmt: skip
        state = load_checkpoint(self.path, fields=self.fields)
        load_full_state(self.model, self.optimizer, state.pop("model"), state.pop("optimizer"),
                        fsdp=self.fsdp)  # fmt: skip
        return state, state["ranks"][self.runtime.rank]
