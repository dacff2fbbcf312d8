"""The single exception type of minifloat.data."""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """Bad or missing training data; the message is one line saying what to do about it."""
