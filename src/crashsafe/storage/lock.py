"""One writer per checkpoint directory: an advisory ``flock`` that dies with its process.

A process remembers who in it holds each lock (a note the opener gives with :func:`held_by`, else
where the writer was opened), so a second writer in the same process is told what holds the
directory and how to release it, not just its own pid."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

from crashsafe.errors import LockedError, StorageError
from crashsafe.storage.base import Lock
from crashsafe.storage.layout import LOCK_NAME
from crashsafe.storage.localdir import LocalDir, UnsafeEntryError

__all__ = ["WriterLock", "held_by"]

_NOTE: ContextVar[str | None] = ContextVar("crashsafe_lock_note", default=None)
_HELD: dict[tuple[int, int], str] = {}  # this process's locks: (device, inode) of the lock file -> holder
_PACKAGE = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def held_by(note: str) -> Iterator[None]:
    """Writers opened inside are described by ``note`` to a second writer of this process: what holds
    the directory and how to release it ("the CrashsafeCheckpointIO of a Trainer ...; call ...")."""
    token = _NOTE.set(note)
    try:
        yield
    finally:
        _NOTE.reset(token)


def _opened_at() -> str:
    """A writer without a note: where the code outside crashsafe opened it."""
    frame = sys._getframe(1)
    while frame.f_back is not None and Path(frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE):
        frame = frame.f_back
    return (
        f"a CheckpointManager opened at {frame.f_code.co_filename}:{frame.f_lineno} and not closed "
        "yet; call its close() (or open it in a `with` block) to release the directory"
    )


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
        info = os.fstat(self._fd)
        self._key = (info.st_dev, info.st_ino)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = self._read_holder()
            os.close(self._fd)
            self._fd = None
            if pid == os.getpid():
                holder = _HELD.get(self._key, "a CheckpointManager not closed yet; close it")
                raise LockedError(
                    f"{root.path} is being written by another CheckpointManager in this very process "
                    f"(pid {pid}): {holder}. Only one writer per directory is allowed. Readers can open "
                    "it with CheckpointManager(..., read_only=True)."
                ) from None
            raise LockedError(
                f"{root.path} is being written by another CheckpointManager"
                f"{'' if pid is None else f' (pid {pid})'}. Only one writer per directory is allowed: "
                "stop the other job, or use another directory. Readers can open it with "
                "CheckpointManager(..., read_only=True)."
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
        _HELD[self._key] = _NOTE.get() or _opened_at()
        self._pid = os.getpid()  # a forked child shares the lock: only this process lets it go

    def _read_holder(self) -> int | None:
        assert self._fd is not None
        with contextlib.suppress(OSError, ValueError):
            return int(os.pread(self._fd, 32, 0).decode().strip())
        return None

    def release(self) -> None:
        if self._fd is not None:
            _HELD.pop(self._key, None)
            if os.getpid() == self._pid:  # in a forked child, unlocking would free its parent's lock
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
