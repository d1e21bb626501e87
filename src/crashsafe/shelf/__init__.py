"""Persistent-memory shelf (PyMM): variables in a memory-mapped arena, changed in crash-consistent
transactions, recovered on reopen. See ``docs/shelf.md``."""

from crashsafe.shelf.errors import (
    CorruptShelfError,
    NotAShelfError,
    ShelfError,
    ShelfFullError,
    ShelfRecoveredWarning,
)
from crashsafe.shelf.loop import Loop
from crashsafe.shelf.recovery import RecoveryInfo
from crashsafe.shelf.shelf import Shelf, Transaction, VarInfo

__all__ = [
    "CorruptShelfError",
    "Loop",
    "NotAShelfError",
    "RecoveryInfo",
    "Shelf",
    "ShelfError",
    "ShelfFullError",
    "ShelfRecoveredWarning",
    "Transaction",
    "VarInfo",
]
