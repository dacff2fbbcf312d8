"""Type checks of settings as users write them (TOML, flags): ``check_setting_type``.

An integral float counts as an integer (TOML writes ``2e9`` as a float), an integer as a float;
``True`` is not a count. A value that does not fit raises a one-line :class:`ConfigError`.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Mapping
from typing import Any

from minifloat.train.errors import ConfigError

__all__ = ["check_setting_type"]


class _WrongType(Exception):
    """Internal: a value does not fit a type annotation."""


_TYPE_WORDS: dict[Any, str] = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
}


def _describe(annotation: Any) -> str:
    """Words for the values ``annotation`` admits, as a user writes them (None is not)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args if a is not type(None))
    if origin is tuple:
        return "a list of numbers" if Ellipsis in args else f"a list of {len(args)} numbers"
    if origin in (Mapping, dict):
        return "a table of KEY = VALUE"
    return _TYPE_WORDS.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _coerce(value: Any, annotation: Any) -> Any:
    """``value`` as ``annotation`` admits it, or raise _WrongType."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is not type(None):
                try:
                    return _coerce(value, arg)
                except _WrongType:
                    pass
        raise _WrongType
    if annotation is bool and isinstance(value, bool):
        return value
    if isinstance(value, bool):  # True is an int to Python, but not a count or a rate
        raise _WrongType
    if annotation is int:
        if isinstance(value, int):
            return value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)  # TOML writes 2e9 as a float
        raise _WrongType
    if annotation is float and isinstance(value, int | float):
        return float(value)
    if annotation is str and isinstance(value, str):
        return value
    if origin is tuple and isinstance(value, list | tuple) and args[-1:] == (Ellipsis,):
        return tuple(_coerce(v, args[0]) for v in value)
    if origin is tuple and isinstance(value, list | tuple) and len(value) == len(args):
        return tuple(_coerce(v, a) for v, a in zip(value, args, strict=True))
    mapping = origin in (Mapping, dict) and isinstance(value, Mapping)
    if mapping and all(isinstance(k, str) for k in value):
        return dict(value)
    raise _WrongType


def check_setting_type(name: str, value: Any, annotation: Any) -> Any:
    """Return ``value`` converted to the type ``annotation`` names (an integral float to int,
    an int to float); raise :class:`ConfigError` "NAME must be TYPE, got VALUE" otherwise."""
    try:
        return _coerce(value, annotation)
    except _WrongType:
        raise ConfigError(f"{name} must be {_describe(annotation)}, got {value!r}") from None
