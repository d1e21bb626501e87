"""One writer per checkpoint directory: an advisory ``flock`` that dies with its process."""

from __future__ import annotations

import contextlib
import fcntl
import os

from crashsafe.errors import LockedError, StorageError
from crashsafe.storage.base import Lock
from crashsafe.storage.layout import LOCK_NAME
from crashsafe.storage.localdir import LocalDir, UnsafeEntryError

__all__ = ["WriterLock"]


class WriterLock(Lock):
    """Exclusive writer lock on ``root/.lock``. A SIGKILLed holder releases it automatically.

    The lock file is opened relative to the directory fd without following links: a ``.lock``
    that is a symlink (or a FIFO, or a directory) is refused, never truncated through.
    """

    def __init__(self, root: LocalDir) -> None:
        self.path = root.path / LOCK_NAME
        try:
            self._fd: int | None = root.open_lock_file(LOCK_NAME)
        except UnsafeEntryError as exc:
            raise StorageError(
                f"refusing the lock file: {exc}. Remove {self.path} (crashsafe recreates it)"
            ) from None
        except OSError as exc:
            raise StorageError(
                exc.errno,
                f"cannot create the lock file {self.path}: "
                f"{exc.strerror}. Check that the directory is writable",
            ) from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read_holder()
            os.close(self._fd)
            self._fd = None
            raise LockedError(
                f"{root.path} is being written by another CheckpointManager{holder}. Only one writer "
                "per directory is allowed: stop the other job, or use another directory. Readers "
                "can open it with CheckpointManager(..., read_only=True)."
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
        self._pid = os.getpid()  # a forked child shares the lock: only this process lets it go

    def _read_holder(self) -> str:
        assert self._fd is not None
        with contextlib.suppress(OSError, ValueError):
            pid = int(os.pread(self._fd, 32, 0).decode().strip())
            return f" (pid {pid})"
        return ""

    def release(self) -> None:
        if self._fd is not None:
            if os.getpid() == self._pid:  # in a forked child, unlocking would free its parent's lock
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
