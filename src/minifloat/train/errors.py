"""The trainer's exceptions and warning; the CLI shows each as one line ``minifloat: ...``.

User errors (a bad setting, a run directory in use, a checkpoint that does not fit) subclass
``ValueError`` or :class:`CheckpointError`; a run that started but must not count as a success
(too many skipped steps, out of memory) raises :class:`RunFailed`; a run stopped by SIGINT or
SIGTERM raises :class:`TrainingInterrupted` after writing its checkpoint.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "ConfigError",
    "RunDirError",
    "RunFailed",
    "RunWarning",
    "TrainingInterrupted",
]


class ConfigError(ValueError):
    """An invalid training setting (one-line message, shown to CLI users as is)."""


class RunDirError(ValueError):
    """The run directory cannot be used: another run holds it, or it already holds a run that
    would be replaced (without ``--resume`` or ``--overwrite``)."""


class CheckpointError(Exception):
    """A checkpoint is missing, unreadable, corrupt, or does not match the current run."""


class CheckpointMismatchError(CheckpointError):
    """A readable checkpoint written by a different run (other settings or world size): resuming
    from an older checkpoint of the same directory would not help, so there is no fallback."""


class RunFailed(RuntimeError):
    """The run cannot make progress (most steps skipped, out of memory); ``result`` is the
    run's :class:`~minifloat.train.result.TrainResult` when it got that far (else None)."""

    def __init__(self, message: str, *, result: Any = None) -> None:
        super().__init__(message)
        self.result = result


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the run after step ``step``; ``checkpoint`` is the checkpoint
    written then (None when the run saves none), or for a second SIGINT, which stops the run at
    once, the newest one (``message`` then says so). A KeyboardInterrupt, so code that cleans up
    after Ctrl-C does the same here."""

    def __init__(
        self, signum: int, step: int, checkpoint: Path | None, *, message: str | None = None
    ) -> None:
        name = signal.Signals(signum).name
        saved = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (this run saves none)"
        super().__init__(message or f"interrupted by {name} after step {step}; {saved}")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


class RunWarning(UserWarning):
    """Something was repaired or worked around (a damaged checkpoint or metrics line); the CLI
    prints it as ``minifloat: warning: ...``."""
