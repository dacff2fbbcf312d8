"""The run directory: one run at a time, no run replaced by accident, no temporary files left.

:class:`RunDirectory` is opened before any data work and closed when the run ends:

* **Exclusive**: an advisory ``flock`` on ``<out>/.run.lock``, which names its holder (pid, host,
  start time). A second run on the same directory fails at once with a one-line error naming
  the holder, instead of interleaving records and replacing checkpoints. The kernel releases the
  lock when its process dies, so a killed run never blocks the next one. (On network filesystems
  ``flock`` may only exclude runs on the same host.)
* **No accidental replacement**: a new run in a directory that holds a run (its
  ``metrics.jsonl`` or checkpoints) is refused unless it resumes it (``--resume``) or replaces it
  (``--overwrite``, which deletes that run's metrics, checkpoints and TensorBoard events).
* **No temporary files left behind**: what a killed save or metrics rewrite left (``.*.tmp``)
  is removed once the lock is held, when nobody else can be writing it.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import shutil
import socket
from pathlib import Path

from minifloat.train.errors import RunDirError

__all__ = ["LOCK_NAME", "RunDirectory", "run_files"]

LOCK_NAME = ".run.lock"
METRICS_NAME = "metrics.jsonl"
TENSORBOARD_NAME = "tensorboard"
# Names of a run's checkpoints: checkpoint.pt, checkpoint.1.pt, ..., checkpoint.dcp/, ... and a
# sharded save's ".checkpoint.dcp.old" left by a crash between its two renames.
_CHECKPOINT_PATTERNS = ("checkpoint.pt", "checkpoint.*.pt", "checkpoint.dcp", "checkpoint.*.dcp",
                        ".checkpoint.dcp.old")  # fmt: skip
# Temporary files of the trainer's atomic writes (checkpoint.py, sharded_checkpoint.py,
# metrics.py): ".checkpoint.pt.<random>.tmp", ".checkpoint.dcp.tmp", ".metrics.jsonl.<random>.tmp".
_TEMP_PATTERNS = (".checkpoint*.tmp", ".metrics.jsonl*.tmp")


def run_files(directory: Path) -> list[Path]:
    """The files of a run in ``directory``: its metrics and checkpoints (sorted)."""
    found = {p for pattern in _CHECKPOINT_PATTERNS for p in directory.glob(pattern)}
    if (directory / METRICS_NAME).exists():
        found.add(directory / METRICS_NAME)
    return sorted(found)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


class RunDirectory:
    """The directory of one run, held exclusively between :meth:`open` and :meth:`close`.

    ``resume``: the run continues the one in the directory. ``overwrite``: it may replace it.
    ``resumable``: the run writes checkpoints, so ``--resume`` is a way out worth naming.
    """

    def __init__(self, path: Path, *, resume: bool, overwrite: bool, resumable: bool) -> None:
        self.path = Path(path)
        self.resume, self.overwrite, self.resumable = resume, overwrite, resumable
        self._fd: int | None = None
        self._created: list[Path] = []  # directories this run created, innermost first

    @property
    def lock_path(self) -> Path:
        return self.path / LOCK_NAME

    def open(self) -> None:
        """Create the directory if needed, take the lock, check for (or replace) an earlier
        run, and remove stale temporary files. Raises :class:`RunDirError`."""
        self._created = [d for d in (self.path, *self.path.parents) if not d.exists()]
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):  # the path, or a parent, is a file
            file = next(d for d in (self.path, *self.path.parents) if d.exists() and not d.is_dir())
            where = "" if file == self.path else f": {file}"
            raise RunDirError(f"--out {self.path}{where} exists and is not a directory") from None
        self._lock()
        try:
            self._check_earlier_run()
            for pattern in _TEMP_PATTERNS:
                for stale in self.path.glob(pattern):
                    _remove(stale)
        except BaseException:
            self.close()
            raise

    def _lock(self) -> None:
        while True:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 4096).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise RunDirError(
                    f"{self.path} is in use by another run ({holder}); wait for it to finish "
                    "or give another --out"
                ) from None
            # The previous holder may have removed the file between our open and our lock:
            # then we hold a lock on a file nobody else will see. Start over.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.lock_path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        holder = f"pid {os.getpid()} on host {socket.gethostname()}, since {since}"
        os.ftruncate(fd, 0)
        os.write(fd, holder.encode())
        os.fsync(fd)
        self._fd = fd

    def _check_earlier_run(self) -> None:
        files = run_files(self.path)
        if not files or self.resume:
            return
        if not self.overwrite:
            names = ", ".join(p.name for p in files[:3]) + (", ..." if len(files) > 3 else "")
            ways = "continue it with --resume or " if self.resumable else ""
            raise RunDirError(
                f"{self.path} already holds a run ({names}); {ways}replace it with --overwrite"
            )
        for path in [*files, self.path / TENSORBOARD_NAME]:
            if path.exists():
                _remove(path)

    def close(self) -> None:
        """Release the lock (removing the lock file) and remove the directories this run
        created if it left nothing in them (e.g. it failed before writing anything)."""
        if self._fd is not None:
            self.lock_path.unlink(missing_ok=True)  # while still holding it: see _lock
            os.close(self._fd)
            self._fd = None
        for directory in self._created:
            if not directory.is_dir() or any(directory.iterdir()):
                break
            directory.rmdir()
        self._created = []
