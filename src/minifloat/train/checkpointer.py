"""Where a run keeps its checkpoints, in either format, and what a stored run says about itself.

A run directory holds ``checkpoint.pt`` (the full format, :mod:`minifloat.train.checkpoint`) or
``checkpoint.dcp/`` (the sharded format, :mod:`minifloat.train.sharded_checkpoint`). This module
knows both; the two format modules know only :mod:`minifloat.train.integrity`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from minifloat.train.checkpoint import read_checkpoint_config
from minifloat.train.integrity import CheckpointError
from minifloat.train.sharded_checkpoint import read_sharded_config

__all__ = ["CHECKPOINT_NAME", "SHARDED_CHECKPOINT_NAME", "read_stored_config"]

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
