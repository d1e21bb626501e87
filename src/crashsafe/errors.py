"""One error hierarchy. Every message names the problem and the next step.

Each subclass also inherits the matching builtin (``TypeError``, ``OSError``, ...) so callers
that already catch builtins keep working.
"""

from __future__ import annotations

__all__ = [
    "CheckpointExistsError",
    "CodecError",
    "CoordinationError",
    "CorruptCheckpointError",
    "CorruptCheckpointWarning",
    "CrashsafeError",
    "CrashsafeWarning",
    "DiskFullError",
    "InvalidArgumentError",
    "LockedError",
    "MirrorWarning",
    "NoCheckpointError",
    "RetentionWarning",
    "SaveFailedError",
    "StorageError",
    "UnsupportedStateError",
]


class CrashsafeError(Exception):
    """Base class of every error crashsafe raises."""


class UnsupportedStateError(CrashsafeError, TypeError):
    """The state contains a value crashsafe cannot checkpoint; the message names its path."""


class LockedError(CrashsafeError, RuntimeError):
    """Another writer holds the checkpoint directory."""


class NoCheckpointError(CrashsafeError, FileNotFoundError):
    """No committed checkpoint exists where one was asked for."""


class CheckpointExistsError(CrashsafeError, FileExistsError):
    """A step is already committed; committed checkpoints are never overwritten."""


class InvalidArgumentError(CrashsafeError, ValueError):
    """An argument crashsafe was given cannot be used (a step out of range, an empty location); the
    message names it and what to give instead."""


class CorruptCheckpointError(CrashsafeError, ValueError):
    """A checkpoint failed verification (checksum, structure or missing file)."""


class CrashsafeWarning(UserWarning):
    """Base class of every warning crashsafe issues (filter them all with this one class)."""


class CorruptCheckpointWarning(CrashsafeWarning):
    """Issued when restore skips a damaged checkpoint and falls back to an older one."""


class MirrorWarning(CrashsafeWarning):
    """The mirror (second tier) could not be written or listed for now; the local tier is used and
    the copy is retried."""


class RetentionWarning(CrashsafeWarning):
    """A step was committed, but retention could not delete older steps for now; they stay until a
    later retention (after the next save, or ``crashsafe gc``) deletes them."""


class StorageError(CrashsafeError, OSError):
    """The storage refused an operation (permissions, missing directory, I/O error)."""


class DiskFullError(StorageError):
    """The device ran out of space while writing a checkpoint."""


class SaveFailedError(CrashsafeError, RuntimeError):
    """A background save failed; committed checkpoints are untouched."""


class CoordinationError(CrashsafeError, RuntimeError):
    """The ranks of a distributed manager could not agree in time (a rank died or hangs); nothing
    was committed."""


class CodecError(CrashsafeError, ValueError):
    """A codec was misconfigured, unknown, or given data it cannot encode."""
