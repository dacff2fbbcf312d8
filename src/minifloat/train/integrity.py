"""What both checkpoint formats share: the error type, digests, fingerprints, safe reads.

:mod:`minifloat.train.checkpoint` (one file) and :mod:`minifloat.train.sharded_checkpoint` (a
directory of shards) build on this module and not on each other.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from minifloat.errors import first_line
from minifloat.train.errors import CheckpointError

__all__ = [
    "CheckpointError",
    "check_header",
    "content_digest",
    "describe_mismatch",
    "fingerprint",
    "fsync_dir",
    "read_torch_file",
]


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


def check_header(
    body: Any,
    path: str | os.PathLike,
    *,
    fmt: str,
    version: int,
    what: str,
    not_this_format: str,
) -> None:
    """Check a loaded checkpoint body's format, version and digest (popped from `body`).

    `what` names the digested part in the error ("content", "manifest"); `not_this_format` is
    the error message when `body` is not of format `fmt` at all.
    """
    if not isinstance(body, dict) or body.get("format") != fmt:
        raise CheckpointError(not_this_format)
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


def read_torch_file(path: Path, *, mmap: bool = False) -> Any:
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
