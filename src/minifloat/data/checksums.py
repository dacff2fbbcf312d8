"""Sizes and sha256 digests of a cache directory's files: recorded when the cache is built,
verified every time it is loaded.

A token cache is derived data that training trusts blindly: a file of zeros trains silently on
garbage, a truncated one on a fraction of the data. Recording each file's byte length and sha256
in the cache's metadata and checking both on load turns either into a clear reason (and a
rebuild). Hashing runs at about 1 GB/s, small next to reading and hashing the corpus, which
`build_dataset` does on every call anyway.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["describe_files", "verify_files"]

_CHUNK = 1 << 20


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def describe_files(directory: Path, names: list[str]) -> dict[str, dict[str, int | str]]:
    """``{name: {"bytes": size, "sha256": hex}}`` for the files ``names`` of ``directory``."""
    return {
        name: {"bytes": (directory / name).stat().st_size, "sha256": _sha256(directory / name)}
        for name in sorted(names)
    }


def verify_files(directory: Path, records: object) -> str | None:
    """Why ``directory``'s files do not match ``records`` (from ``describe_files``), or None.

    The reason is one phrase naming the first bad file: missing, wrong size (truncated or
    grown), or wrong content (same size, different sha256).
    """
    if not isinstance(records, dict) or not records:
        return "no file checksums recorded"
    for name, record in records.items():
        path = directory / name
        try:
            size = path.stat().st_size
        except OSError:
            return f"{name} is missing"
        if not isinstance(record, dict) or not isinstance(record.get("bytes"), int):
            return f"the checksum record of {name} is malformed"
        if size != record["bytes"]:
            return f"{name} has {size:,} bytes, expected {record['bytes']:,}"
        if _sha256(path) != record["sha256"]:
            return f"{name} does not match its recorded sha256"
    return None
