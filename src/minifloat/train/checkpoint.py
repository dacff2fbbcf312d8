"""Atomic, self-verifying training checkpoints.

A checkpoint is one ``torch.save`` file holding the whole training state (model, optimizer, loss
scaler, step guard, data-iterator positions, RNG states, step, config). Three properties matter:

* **Atomic**: written to a temporary file in the same directory, fsynced, then ``os.replace``-d
  over the old one, so a crash mid-save leaves the previous checkpoint intact.
* **Verified**: a SHA-256 over the content (every tensor's bytes and every scalar) is stored in
  the file and recomputed on load; a flipped bit or a truncated file raises
  :class:`CheckpointError` instead of resuming from silently damaged weights.
* **Matched**: a fingerprint of the settings that determine the training trajectory (recipe,
  model, data, batch, schedule, seed, ...) is stored; resuming under different settings raises
  :class:`CheckpointError` naming the differing fields, never a silent fresh start.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minifloat.train.errors import CheckpointMismatchError
from minifloat.train.integrity import (
    CheckpointError,
    check_header,
    content_digest,
    describe_mismatch,
    fingerprint,
    fsync_dir,
    read_torch_file,
)

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_VERSION",
    "CheckpointError",
    "capture_rng_state",
    "load_checkpoint",
    "read_checkpoint_config",
    "read_checkpoint_header",
    "restore_rng_state",
    "save_checkpoint",
]

CHECKPOINT_FORMAT = "minifloat-checkpoint"
CHECKPOINT_VERSION = 1
_NO_HEADER = "a torch file, but without a minifloat header"


def save_checkpoint(
    path: str | os.PathLike,
    state: Mapping[str, Any],
    *,
    fields: Mapping[str, Any],
    before_replace: Callable[[], None] | None = None,
) -> Path:
    """Atomically write ``state`` to ``path`` with a format header, fingerprint and digest.

    ``fields`` are the run settings the fingerprint covers; they are stored in plain form so a
    mismatch can be reported field by field. ``before_replace`` runs once the new file is
    complete on disk, just before it takes ``path``'s name (to rotate the older checkpoints
    only when there is a new one to take their place: a failed write leaves them all).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "fields": json.loads(json.dumps(dict(fields), default=str)),
        "fingerprint": fingerprint(fields),
        "state": dict(state),
    }
    body["digest"] = content_digest(body)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(body, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a checkpoint is an ordinary output file
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def load_checkpoint(
    path: str | os.PathLike, *, fields: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Read, verify and return the ``state`` saved by :func:`save_checkpoint`.

    Raises :class:`CheckpointError` when the file is missing, unreadable, corrupt, of another
    format or version, or (if ``fields`` is given) written under different run settings.
    """
    body = read_torch_file(Path(path))
    check_header(body, path, fmt=CHECKPOINT_FORMAT, version=CHECKPOINT_VERSION, what="content",
                 not_this_format=_not_minifloat(path))  # fmt: skip
    if fields is not None and body["fingerprint"] != fingerprint(fields):
        raise CheckpointMismatchError(
            f"checkpoint {path} was written by a different run "
            f"({describe_mismatch(body['fields'], fields)})"
        )
    return body["state"]


def _not_minifloat(path: str | os.PathLike) -> str:
    return f"{path} is not a valid minifloat checkpoint ({_NO_HEADER})"


def _mapped_body(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint at ``path`` with its tensors memory-mapped, the digest not checked."""
    body = read_torch_file(Path(path), mmap=True)
    if not isinstance(body, dict) or body.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(_not_minifloat(path))
    return body


def read_checkpoint_config(path: str | os.PathLike) -> Any:
    """The ``state["config"]`` of the full checkpoint at ``path`` (None if absent), reading only
    the small parts (tensors stay memory-mapped) and without checking the digest."""
    state = _mapped_body(path).get("state")
    return state.get("config") if isinstance(state, dict) else None


def read_checkpoint_header(path: str | os.PathLike) -> dict[str, Any]:
    """``{"step", "fields", "fingerprint"}`` of the full checkpoint at ``path``, read as
    :func:`read_checkpoint_config` reads (to choose a checkpoint before loading one)."""
    body = _mapped_body(path)
    state = body.get("state")
    try:
        return {"step": int(state["step"]), "fields": dict(body["fields"]),
                "fingerprint": str(body["fingerprint"])}  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} has no readable header ({exc!r})") from None


def capture_rng_state() -> dict[str, Any]:
    """RNG states of python ``random``, numpy, torch CPU and (if initialized) every CUDA device."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
