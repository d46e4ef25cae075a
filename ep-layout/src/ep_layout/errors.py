"""Errors raised by ep-layout."""

from __future__ import annotations

__all__ = ["EPLayoutError", "LayoutValueError"]


class EPLayoutError(Exception):
    """Base class of every ep-layout error."""


class LayoutValueError(EPLayoutError, ValueError):
    """A layout argument is out of range; the message names it, what was expected, and what was got."""
