"""How minifloat turns an exception into the one line a user sees."""

from __future__ import annotations

__all__ = ["first_line"]


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type name when the message is empty).

    Library errors that wrap another exception, and the CLI's ``minifloat: error: ...``, quote
    only this line: the rest of a torch or Python message is advice or a dump, not the reason.
    A KeyError's message is its quoted key; the quotes are dropped.
    """
    text = str(exc).strip()
    if isinstance(exc, KeyError) and text.startswith("'"):
        text = text.strip("'")
    return text.splitlines()[0] if text else type(exc).__name__
