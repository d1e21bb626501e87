"""OSError -> the crashsafe error that says what happened and what to do next."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

from crashsafe.errors import DiskFullError, StorageError

__all__ = ["storage_error"]


def storage_error(exc: OSError, doing: str, still_there: Callable[[], bool] | None = None) -> StorageError:
    """Translate an OSError met while ``doing`` something.

    With ``still_there``, first check that the checkpoint location still exists: if it was deleted
    or replaced, that is the error to report (its committed steps are gone from its path).
    """
    if still_there is not None and not still_there():
        return StorageError(
            errno.ENOENT,
            f"the checkpoint directory was deleted or replaced while {doing}; nothing was written "
            "there and the steps it held are gone from that path. Find out what removed it, then "
            "create a new CheckpointManager",
        )
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(
            exc.errno,
            f"no space left on the device while {doing}. Free space or lower keep_last; committed "
            "checkpoints are intact",
        )
    if exc.errno == errno.ENOTDIR or (exc.errno == errno.EEXIST and doing.startswith("creating")):
        return _not_a_directory(exc, doing)  # EEXIST: a directory to create is already something else
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return StorageError(
            exc.errno,
            f"permission denied while {doing} ({exc.strerror}). Make the checkpoint directory "
            "writable; committed checkpoints are intact",
        )
    return StorageError(
        exc.errno, f"I/O error while {doing}: {exc.strerror or exc}. Committed checkpoints are intact"
    )


def _not_a_directory(exc: OSError, doing: str) -> StorageError:
    """ENOTDIR said plainly: the path (or a folder on the way to it) is a file, FIFO or device, where
    a directory must be; "[Errno 20] I/O error ... Not a directory" hid that. The errno stays set."""
    where = "a path there" if exc.filename is None else os.fsdecode(exc.filename)
    error = StorageError(
        f"{where} is not a directory (it, or a folder on the way to it, is a file, FIFO or device); met "
        f"while {doing}. Give the checkpoint directory itself, the one the run saves into"
    )
    error.errno = errno.ENOTDIR
    return error
