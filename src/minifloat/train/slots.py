"""The newest N checkpoints of a run, by name: ``checkpoint.pt`` is the newest, then
``checkpoint.1.pt``, ``checkpoint.2.pt``, ... (``checkpoint.dcp/``, ``checkpoint.1.dcp/`` for
sharded ones). The newest keeps its name, so scripts and ``minifloat export`` find it as before.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

__all__ = ["existing_slots", "rotate", "slot_path"]


def slot_path(path: Path, index: int) -> Path:
    """The name of the ``index``-th newest checkpoint (0: ``path`` itself)."""
    return path if index == 0 else path.with_name(f"{path.stem}.{index}{path.suffix}")


def _indexed(path: Path) -> list[tuple[int, Path]]:
    pattern = re.compile(rf"{re.escape(path.stem)}\.(\d+){re.escape(path.suffix)}")
    found = [(0, path)] if path.exists() else []
    for entry in path.parent.glob(f"{path.stem}.*{path.suffix}"):
        match = pattern.fullmatch(entry.name)
        if match and int(match.group(1)) > 0:
            found.append((int(match.group(1)), entry))
    return sorted(found)


def existing_slots(path: Path) -> list[Path]:
    """The checkpoints of ``path``'s family that exist, newest first."""
    return [p for _, p in _indexed(path)]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def rotate(path: Path, keep: int) -> None:
    """Make room for a new newest checkpoint at ``path``, keeping ``keep`` in all.

    Every older checkpoint moves one slot down and those that would land at slot ``keep`` or
    beyond are deleted. The newest itself (``path``) stays where it is when ``keep`` is 1 (the
    caller replaces it atomically); otherwise a file becomes slot 1 by a hard link, so ``path``
    never disappears, and a directory (or a file on a filesystem without hard links) is renamed
    to slot 1: until the new one is renamed into place only slot 1 exists, which a resume finds.
    """
    newest_exists = path.exists()
    for index, entry in reversed(_indexed(path)):
        if index == 0:
            continue
        if not newest_exists:  # slot 0 is free (a crash, or a damaged one removed): no shift
            if index >= keep:
                _remove(entry)
        elif index + 1 >= keep:
            _remove(entry)
        else:
            os.replace(entry, slot_path(path, index + 1))
    if keep < 2 or not newest_exists:
        return
    first = slot_path(path, 1)
    if path.is_file():
        try:
            os.link(path, first)
            return
        except OSError:
            pass
    os.replace(path, first)
