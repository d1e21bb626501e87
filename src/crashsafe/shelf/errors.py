"""Errors and warnings of the shelf; each message names the problem and the next step."""

from __future__ import annotations

from crashsafe.errors import CrashsafeError, CrashsafeWarning

__all__ = [
    "CorruptShelfError",
    "NotAShelfError",
    "ShelfError",
    "ShelfFullError",
    "ShelfRecoveredWarning",
]


class ShelfError(CrashsafeError, RuntimeError):
    """A shelf operation was refused (closed shelf, nested transaction, read-only view, ...)."""


class NotAShelfError(ShelfError, ValueError):
    """The file is not a crashsafe shelf (wrong magic, empty, or written by a newer format)."""


class CorruptShelfError(ShelfError, ValueError):
    """The shelf's metadata or data failed its checksum; nothing was changed or "repaired"."""


class ShelfFullError(ShelfError, MemoryError):
    """The arena (or its metadata area) has no room; the shelf's committed data is intact."""


class ShelfRecoveredWarning(CrashsafeWarning):
    """Opening a shelf rolled back a transaction that a crash left incomplete."""
