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

import hashlib
import json
import os
import random
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minifloat.errors import first_line

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_VERSION",
    "CheckpointError",
    "capture_rng_state",
    "check_header",
    "content_digest",
    "describe_mismatch",
    "fingerprint",
    "fsync_dir",
    "load_checkpoint",
    "read_stored_config",
    "restore_rng_state",
    "save_checkpoint",
]

CHECKPOINT_FORMAT = "minifloat-checkpoint"
CHECKPOINT_VERSION = 1
_NO_HEADER = "a torch file, but without a minifloat header"


class CheckpointError(Exception):
    """A checkpoint is missing, unreadable, corrupt, or does not match the current run."""


def fingerprint(fields: Mapping[str, Any]) -> str:
    """Stable SHA-256 (hex) of JSON-serializable settings; key order does not matter."""
    text = json.dumps(dict(fields), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _hash_into(h: Any, obj: Any) -> None:
    """Feed a canonical serialization of ``obj`` (nested containers of tensors/scalars) to h."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, Mapping):
        h.update(b"{")
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode())
            _hash_into(h, obj[key])
        h.update(b"}")
    elif isinstance(obj, list | tuple):
        h.update(b"[")
        for item in obj:
            _hash_into(h, item)
        h.update(b"]")
    else:
        h.update(f"{type(obj).__name__}:{obj!r};".encode())


def content_digest(payload: Mapping[str, Any]) -> str:
    """SHA-256 (hex) over nested containers of tensors and scalars (bytes, dtypes, shapes)."""
    h = hashlib.sha256()
    _hash_into(h, payload)
    return h.hexdigest()


def save_checkpoint(
    path: str | os.PathLike, state: Mapping[str, Any], *, fields: Mapping[str, Any]
) -> Path:
    """Atomically write ``state`` to ``path`` with a format header, fingerprint and digest.

    ``fields`` are the run settings the fingerprint covers; they are stored in plain form so a
    mismatch can be reported field by field.
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
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def fsync_dir(directory: Path) -> None:
    """fsync a directory, so the renames inside it are durable (best effort)."""
    # Makes the rename itself durable; not supported on every platform/filesystem.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_header(body: Any, path: str | os.PathLike, *, fmt: str, version: int, what: str) -> None:
    """Check a loaded checkpoint body's format, version and digest (popped from `body`).

    `what` names the digested part in the error ("content", "manifest").
    """
    if not isinstance(body, dict) or body.get("format") != fmt:
        if fmt == CHECKPOINT_FORMAT:
            raise CheckpointError(f"{path} is not a valid minifloat checkpoint ({_NO_HEADER})")
        raise CheckpointError(f"{path} is not a minifloat sharded checkpoint")
    if body.get("version") != version:
        raise CheckpointError(
            f"checkpoint {path} has format version {body.get('version')}, "
            f"this minifloat reads version {version}"
        )
    digest = body.pop("digest", None)
    if digest != content_digest(body):
        raise CheckpointError(f"checkpoint {path} is corrupt ({what} digest mismatch)")


def describe_mismatch(saved: Mapping[str, Any], current: Mapping[str, Any]) -> str:
    """'field: checkpoint=..., now=...' for every setting that differs (saved in plain form)."""
    current = json.loads(json.dumps(dict(current), default=str))
    keys = sorted(set(saved) | set(current))
    diffs = [
        f"{k}: checkpoint={saved.get(k, '<absent>')!r}, now={current.get(k, '<absent>')!r}"
        for k in keys
        if saved.get(k, "<absent>") != current.get(k, "<absent>")
    ]
    if not diffs:
        return "fingerprint differs"
    if saved.get("total_steps") != current.get("total_steps"):
        diffs.append("the LR schedule spans total_steps, so a resume keeps the run's steps/tokens")
    return "; ".join(diffs)


def load_checkpoint(
    path: str | os.PathLike, *, fields: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Read, verify and return the ``state`` saved by :func:`save_checkpoint`.

    Raises :class:`CheckpointError` when the file is missing, unreadable, corrupt, of another
    format or version, or (if ``fields`` is given) written under different run settings.
    """
    body = _read_body(Path(path), mmap=False)
    check_header(body, path, fmt=CHECKPOINT_FORMAT, version=CHECKPOINT_VERSION, what="content")
    if fields is not None and body["fingerprint"] != fingerprint(fields):
        raise CheckpointError(
            f"checkpoint {path} was written by a different run "
            f"({describe_mismatch(body['fields'], fields)})"
        )
    return body["state"]


def _short_reason(exc: BaseException) -> str:
    """A few words on why torch.load failed, without its multi-line advice on weights_only."""
    text = str(exc).strip()
    marker = "WeightsUnpickler error:"
    if marker in text:  # what the unpickler met comes after the advice, on the next lines
        after = [line.strip() for line in text.split(marker, 1)[1].splitlines() if line.strip()]
        what = after[0].split(". ")[0].rstrip(".") if after else "?"
        return f"unsupported pickle content: {what}"
    first = first_line(exc)
    return first if len(first) <= 120 else first[:117] + "..."


def _read_body(path: Path, *, mmap: bool) -> Any:
    """torch.load of a checkpoint file; one-line CheckpointError for anything that is not one.

    ``mmap=True`` maps the tensors instead of reading them (to look at the small parts only).
    """
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    # torch.save always writes a zip archive; anything else (a truncated file, some other file)
    # would reach torch's legacy loader and its long weights_only advice.
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"{path} is not a valid minifloat checkpoint (not a torch zip archive: truncated or "
            "corrupt, or some other kind of file)"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:
        reason = _short_reason(exc)
        raise CheckpointError(f"{path} is not a valid minifloat checkpoint ({reason})") from exc


def read_stored_config(path: str | os.PathLike) -> dict[str, Any]:
    """The run settings (``TrainConfig.to_dict()``) saved in the checkpoint at ``path``.

    ``path`` is a full checkpoint file or a sharded checkpoint directory. Only the small parts
    are read (tensors stay memory-mapped) and the digest is not checked here: resuming loads
    and verifies the whole checkpoint anyway. Raises :class:`CheckpointError`.
    """
    path = Path(path)
    if path.suffix == ".dcp" or path.is_dir():
        # Imported here: sharded_checkpoint builds on this module.
        from minifloat.sharded_checkpoint import GLOBAL_NAME, read_manifest

        directory = Path(read_manifest(path)["path"])
        state = _read_body(directory / GLOBAL_NAME, mmap=True)
    else:
        body = _read_body(path, mmap=True)
        if not isinstance(body, dict) or body.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{path} is not a valid minifloat checkpoint ({_NO_HEADER})")
        state = body.get("state")
    config = state.get("config") if isinstance(state, dict) else None
    if not isinstance(config, dict):
        raise CheckpointError(f"checkpoint {path} holds no run settings")
    return dict(config)


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
