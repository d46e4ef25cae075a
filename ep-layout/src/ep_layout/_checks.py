"""Argument checks shared by the layout classes (private)."""

from __future__ import annotations

import operator

from .errors import LayoutValueError

INT32_MAX = 2**31 - 1


def check_int(name: str, value: object, *, lo: int = 0, hi: int = INT32_MAX, multiple_of: int = 1) -> int:
    """Return ``value`` as an int after checking ``lo <= value <= hi`` and ``value % multiple_of == 0``."""
    if isinstance(value, bool):
        raise LayoutValueError(f"{name}: expected an integer, got the bool {value!r}")
    try:
        result = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise LayoutValueError(f"{name}: expected an integer, got {type(value).__name__} {value!r}") from None
    if not lo <= result <= hi:
        raise LayoutValueError(f"{name}: expected {lo} <= {name} <= {hi}, got {result}")
    if result % multiple_of:
        raise LayoutValueError(
            f"{name}: expected a multiple of {multiple_of}, got {result}; "
            f"pad it up to {(result + multiple_of - 1) // multiple_of * multiple_of}"
        )
    return result
