"""The trainer's exceptions; the CLI shows each as one line ``minifloat: error: ...``.

User errors (a bad setting, a checkpoint that does not fit) subclass ``ValueError`` or
:class:`CheckpointError`; failures of a run that started (too many skipped steps, out of memory)
are :class:`RunFailed`.
"""

from __future__ import annotations

__all__ = ["CheckpointError", "ConfigError"]


class ConfigError(ValueError):
    """An invalid training setting (one-line message, shown to CLI users as is)."""


class CheckpointError(Exception):
    """A checkpoint is missing, unreadable, corrupt, or does not match the current run."""
