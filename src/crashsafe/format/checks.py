"""Checks every part of a manifest shares: int64 bounds, short reprs of untrusted values, the error.

A forged manifest may hold megabyte strings or ints too long for ``repr()``; errors quote them cut
to a line.
"""

from __future__ import annotations

import reprlib
from collections.abc import Collection

from crashsafe.errors import CorruptCheckpointError

__all__ = ["MAX_INT64", "MAX_NDIM", "MIN_INT64", "bad", "checked_int", "member", "show"]

MAX_INT64 = 2**63 - 1
MIN_INT64 = -(2**63)
MAX_NDIM = 64


class _ShortRepr(reprlib.Repr):
    """Reprs cut to a line; ints too long for ``repr()`` are described, not printed."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxdict, self.maxlist = 2, 4, 4
        self.maxstring = self.maxother = 80
        self.maxlong = 40

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 1000:
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_SHORT = _ShortRepr()


def show(value: object) -> str:
    """A short repr of an untrusted value (a forged one may be megabytes long)."""
    return _SHORT.repr(value)


def bad(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where} {what}")


def member(value: object, allowed: Collection[str]) -> bool:
    """``value in allowed`` for untrusted values (a list would make ``in`` raise TypeError)."""
    return isinstance(value, str) and value in allowed


def checked_int(value: object, what: str, where: str, minimum: int = 0, maximum: int = MAX_INT64) -> int:
    """``value`` if it is an int (not a bool) in ``[minimum, maximum]``, else the manifest is bad."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise bad(where, f"has invalid {what}: {show(value)}")
    return value
