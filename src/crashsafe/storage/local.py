"""A local directory as a checkpoint store: a step is a directory that appears by one rename.

The commit protocol (rule 1 of docs/design.md): write payloads into ``.tmp-*/data.bin`` and the
manifest into ``.tmp-*/manifest.json`` -> fsync the data, the manifest and the temporary directory
-> rename it to ``step_<n>`` -> fsync the checkpoint directory. A crash at any instant leaves either
no new step or a complete one; older steps are never touched. Each step of the protocol has a named
kill point (:mod:`crashsafe._faults`) where tests SIGKILL a real process. Every name is resolved
relative to the held checkpoint directory without following links
(:mod:`crashsafe.storage.localdir`).

What makes it cheap (bench/results/storage.md): the three fsyncs before the rename run at once, in
three threads, so the file system serves them with one journal commit instead of three (each
commit costs milliseconds on a busy disk); every one of them still returns before the rename. Small
payloads are gathered and written together, and the kernel starts writing each large piece back
to disk as soon as it is written (``sync_file_range``, Linux), so the disk works while the next
payloads are encoded and the fsync finds little left to do.

A store opened with ``recycle=True`` (the memory tier's, on a RAM disk) keeps the step it deleted
last, renamed out of view, as a spare, and the next draft writes over the spare's data file instead
of a new one: a RAM disk allocates and zeroes every page of a new file, the costliest part of
writing a step there. Only a step already renamed out of view is ever written over, never a
committed one, and only a file no one else has open: a reader that opened or mapped the step before
it was deleted (``load(mmap=True)``'s views, ``crashsafe verify``, in this process or another) keeps
the bytes that were committed, as with a deleted file (Linux grants a write lease only on a file open
nowhere else). A spare that is not a plain regular file of crashsafe's own (a link, a FIFO, a file
with another name for it), or that a reader holds, is never written, only removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import secrets
import stat
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import crashsafe._faults as faults
from crashsafe._runtime import pool
from crashsafe.codecs.base import BytesLike
from crashsafe.errors import (
    CheckpointExistsError,
    CorruptCheckpointError,
    CrashsafeError,
    NoCheckpointError,
    StorageError,
)
from crashsafe.format.manifest import MANIFEST_NAME
from crashsafe.storage.base import Capabilities, Draft, Lock, Store, StoredFile, StoredStep
from crashsafe.storage.layout import TMP_PREFIX, TRASH_PREFIX, committed_steps, is_own, leftovers, step_name
from crashsafe.storage.localdir import LocalDir
from crashsafe.storage.lock import WriterLock
from crashsafe.storage.oserror import storage_error

__all__ = ["DATA_NAME", "LocalStore"]

DATA_NAME = "data.bin"
_CHUNK = 32 << 20  # a large payload is written in pieces of this size, each written back at once
_GATHER = 1 << 20  # payloads smaller than this are gathered and written together (fewer syscalls)


def _writeback_starter() -> Callable[[int, int, int], None]:
    """``start(fd, offset, nbytes)``: let the kernel start writing those bytes to disk now, without
    waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``); elsewhere the fsync does it all."""
    if not sys.platform.startswith("linux"):
        return lambda fd, offset, nbytes: None
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return lambda fd, offset, nbytes: None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    write = 2  # SYNC_FILE_RANGE_WRITE

    def start(fd: int, offset: int, nbytes: int) -> None:
        call(fd, offset, nbytes, write)  # advisory: an error shows again at the fsync

    return start


_start_writeback = _writeback_starter()
_SETLEASE: int | None = getattr(fcntl, "F_SETLEASE", None) if sys.platform.startswith("linux") else None


def _alone(fd: int) -> bool:
    """Whether the file open on ``fd`` is open nowhere else: no other descriptor or mapping of it,
    in any process (Linux grants a write lease only then). False where that cannot be told."""
    if _SETLEASE is None:
        return False
    try:
        fcntl.fcntl(fd, _SETLEASE, fcntl.F_WRLCK)
    except OSError:  # EAGAIN: open elsewhere; EACCES, EINVAL: not ours, or leases are off
        return False
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, _SETLEASE, fcntl.F_UNLCK)
    return True


def _fsync_together(fds: list[int]) -> None:
    """fsync every fd at once (one in this thread, the others in the "fsync" pool), so one journal
    commit can serve them all; returns when every fsync has returned, raising the first error."""
    others = [pool("fsync", 2).submit(os.fsync, fd) for fd in fds[1:]]
    error: OSError | None = None
    try:
        os.fsync(fds[0])
    except OSError as exc:
        error = exc
    for other in others:  # wait for all: the caller closes these fds next
        try:
            other.result()
        except OSError as exc:
            error = error or exc
    if error is not None:
        raise error


class LocalStore(Store):
    """Checkpoints in a local directory, held open by file descriptor for the store's lifetime."""

    capabilities = Capabilities(atomic_rename=True, conditional_put=True, durable_fsync=True)

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        create: bool = False,
        opened: LocalDir | None = None,
        recycle: bool = False,
    ) -> None:
        path = Path(directory)
        self.recycle = recycle  # keep the step deleted last, to write the next step over (a RAM disk)
        if opened is not None:  # (see inside)
            self.root, self.location = opened, str(path)
            return
        if create:
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise storage_error(exc, f"creating the checkpoint directory {path}") from None
        try:
            self.root = LocalDir.open(path)
        except FileNotFoundError:
            raise NoCheckpointError(f"checkpoint directory {path} does not exist") from None
        except OSError as exc:
            raise storage_error(exc, f"opening the checkpoint directory {path}") from None
        self.location = str(path)

    @classmethod
    def inside(cls, parent: LocalDir, name: str, *, recycle: bool = False) -> LocalStore:
        """The store in the entry ``name`` of the open directory ``parent``, opened without following
        a link (UnsafeEntryError for a link, a FIFO, anything but a directory: rule 11)."""
        return cls(parent.path / name, opened=parent.subdir(name), recycle=recycle)

    def steps(self) -> list[int]:
        return committed_steps(self.root)

    def has_step(self, step: int) -> bool:
        return self.root.exists(step_name(step))

    def open_step(self, step: int) -> StoredStep:
        return _LocalStep(self.root, step)

    def begin(self, step: int, *, attempt: str | None = None, part: str | None = None) -> Draft:
        return _LocalDraft(self, step, attempt, part)

    def delete(self, step: int) -> None:
        """Rename the step out of view, fsync, then remove it (a recycling store keeps it as its
        spare if it has none and the step is crashsafe's alone); a ``step_*`` that is a symlink loses
        the link, never the files it points to."""
        root = self.root
        trash = f"{TRASH_PREFIX}{step_name(step)}-{secrets.token_hex(4)}"
        keep = self.recycle and self.spare() is None  # (one spare: what the next draft writes over)
        try:
            root.rename(step_name(step), trash)
            root.fsync()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise storage_error(exc, f"deleting step {step} in {root.path}", root.is_current) from None
        faults.reached("after_trash_rename")
        if keep and is_own(root, trash):  # (a link, or a step holding someone's files: removed as ever)
            return
        try:
            root.remove(trash, after_first=lambda: faults.reached("mid_delete"))
        except OSError as exc:
            raise storage_error(
                exc, f"removing deleted step {step} from {root.path}", root.is_current
            ) from None

    def leftovers(self) -> list[str]:
        return leftovers(self.root)

    def spare(self) -> str | None:
        """A deleted step kept out of view for its data file's pages (``recycle``), if there is one."""
        return next((name for name in leftovers(self.root) if name.startswith(TRASH_PREFIX)), None)

    def remove_leftovers(self, names: Sequence[str]) -> None:
        for name in names:
            with contextlib.suppress(OSError):
                self.root.remove(name)

    def lock(self) -> Lock:
        return WriterLock(self.root)

    def stored_bytes(self, step: int) -> int:
        """Bytes in the step's regular files (links are not followed)."""
        try:
            with self.root.subdir(step_name(step)) as directory:
                sizes = (os.stat(n, dir_fd=directory.fd, follow_symlinks=False) for n in directory.names())
                return sum(st.st_size for st in sizes if stat.S_ISREG(st.st_mode))
        except (OSError, CorruptCheckpointError):
            return 0

    def check_current(self, doing: str) -> None:
        if not self.root.is_current():
            raise storage_error(FileNotFoundError(), f"{doing} in {self.location}", self.root.is_current)

    def close(self) -> None:
        self.root.close()


class _LocalFile(StoredFile):
    def __init__(self, fd: int, where: str, name: str) -> None:
        self._fd = fd
        self._what = f"{where}: {name}"
        self.size = os.fstat(fd).st_size

    def read_into(self, view: memoryview, offset: int) -> None:
        pos = 0
        try:
            while pos < len(view):
                n = os.preadv(self._fd, [view[pos:]], offset + pos)
                if n == 0:
                    raise CorruptCheckpointError(f"{self._what} ended early")
                pos += n
        except OSError as exc:
            if isinstance(exc, CrashsafeError):
                raise
            raise CorruptCheckpointError(
                f"{self._what}: reading failed ({exc.strerror or exc}); the disk may be damaged"
            ) from None

    def fileno(self) -> int | None:
        return self._fd if self._fd >= 0 else None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _LocalStep(StoredStep):
    """A committed step directory, opened relative to the checkpoint directory (no links)."""

    def __init__(self, root: LocalDir, step: int) -> None:
        self.step = step
        self._root = root
        try:
            self._dir = root.subdir(step_name(step))
        except FileNotFoundError:
            raise NoCheckpointError(f"step {step} is not committed in {root.path}") from None
        except (CorruptCheckpointError, OSError) as exc:
            raise _damage(f"checkpoint step {step}", "its directory", exc) from None
        self.where = f"checkpoint step {step} ({self._dir.path})"

    def manifest_bytes(self, limit: int) -> bytes:
        try:
            return self._dir.read_file(MANIFEST_NAME, limit)
        except (CorruptCheckpointError, OSError) as exc:
            raise _damage(self.where, MANIFEST_NAME, exc) from None

    def open_file(self, name: str) -> StoredFile:
        try:
            return _LocalFile(self._dir.open_file(name), self.where, name)
        except (CorruptCheckpointError, OSError) as exc:
            raise _damage(self.where, f"data file {name}", exc) from None

    def vanished(self) -> bool:
        return self._root.entry_identity(step_name(self.step)) != self._dir.identity

    def close(self) -> None:
        self._dir.close()


class _LocalDraft(Draft):
    """``.tmp-step_<n>-<pid>-<hex>/data.bin``, committed by rename. The ranks of a distributed step
    share ``.tmp-step_<n>-<attempt>/`` and each writes its own ``data-<part>.bin`` into it."""

    def __init__(self, store: LocalStore, step: int, attempt: str | None, part: str | None) -> None:
        self._store = store
        self._root = root = store.root
        self.step = step
        self.name = step_name(step)
        if root.exists(self.name):
            raise CheckpointExistsError(
                f"step {step} is already committed in {root.path}; committed checkpoints are never "
                "overwritten. Save under a new step, or delete it first with `crashsafe gc`."
            )
        self.tmp = f"{TMP_PREFIX}{self.name}-{attempt or f'{os.getpid()}-{secrets.token_hex(4)}'}"
        self._data = DATA_NAME if part is None else f"data-{part}.bin"
        self._dir: LocalDir | None = None
        self._fd: int | None = None
        self._offset = 0  # bytes of payloads taken (written or gathered)
        self._written = 0  # bytes written to the data file
        self._gathered = bytearray()  # small payloads not written yet
        self._recycling = False  # writing over a spare's data file (store.recycle)
        try:
            try:
                root.mkdir(self.tmp)
            except FileExistsError:
                if attempt is None:  # only the ranks of one attempt share a temporary directory
                    raise
            faults.reached("after_mkdir_tmp")
            self._dir = root.subdir(self.tmp)
            self._fd = self._recycled() if store.recycle else None
            self._recycling = self._fd is not None  # (cut to what this draft wrote before it is durable)
            if self._fd is None:
                self._fd = self._dir.create_file(self._data)
        except (OSError, CrashsafeError) as exc:
            self.abort()
            raise self._error(exc, f"starting step {step} in {root.path}") from None

    def _recycled(self) -> int | None:
        """The spare's data file (:meth:`LocalStore.spare`), moved into this draft and opened to be
        written over, or None: no spare, or one that is not a regular file with one name or that
        another open file (a reader, a mapping) still holds. The spare is removed either way: one
        refused is never written, and does not stay to keep the next deleted step from being kept."""
        spare = self._store.spare()
        if spare is None:
            return None
        fd = self._take(spare)
        if fd is not None:
            faults.reached("after_recycle")
        with contextlib.suppress(OSError):
            self._root.remove(spare, after_first=lambda: faults.reached("mid_delete"))
        return fd

    def _take(self, spare: str) -> int | None:
        """The data file of ``spare``, moved into this draft, if it is crashsafe's alone (else None)."""
        assert self._dir is not None
        try:
            with self._root.subdir(spare) as folder:
                flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # (a FIFO opens at once)
                fd = os.open(DATA_NAME, flags, dir_fd=folder.fd)
                try:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                        raise OSError(f"{DATA_NAME} of {spare} is not crashsafe's alone")
                    os.rename(DATA_NAME, self._data, src_dir_fd=folder.fd, dst_dir_fd=self._dir.fd)
                    if not _alone(fd):  # moved first: no reader can open it by its name any more
                        os.unlink(self._data, dir_fd=self._dir.fd)  # (its readers keep it, as it is)
                        raise OSError(f"{DATA_NAME} of {spare} is still open elsewhere")
                except BaseException:
                    os.close(fd)
                    raise
        except (OSError, CrashsafeError):
            return None
        return fd

    def write(self, data: BytesLike) -> tuple[str, int]:
        assert self._fd is not None, "draft is closed"
        view = memoryview(data).cast("B")
        start = self._offset
        try:
            if len(view) < _GATHER:
                self._gathered += view
                if len(self._gathered) >= _GATHER:
                    self._flush()
            else:
                self._flush()
                self._write(view)
        except OSError as exc:
            raise self._error(exc, f"writing step {self.step} to {self._root.path}") from None
        self._offset += len(view)
        return self._data, start

    def _flush(self) -> None:
        """Write the gathered small payloads."""
        if self._gathered:
            gathered, self._gathered = self._gathered, bytearray()
            self._write(memoryview(gathered))

    def _finish(self) -> None:
        """Write what is gathered; a file written over is cut to what this draft wrote."""
        self._flush()
        if self._recycling:
            assert self._fd is not None
            os.ftruncate(self._fd, self._written)

    def _write(self, view: memoryview) -> None:
        assert self._fd is not None
        pos = 0
        while pos < len(view):
            n = os.write(self._fd, view[pos : pos + _CHUNK])
            _start_writeback(self._fd, self._written, n)
            self._written += n
            pos += n

    def files(self) -> dict[str, int]:
        return {self._data: self._offset}

    def persist(self) -> None:
        if self._fd is None:
            return
        try:
            self._finish()
            os.fsync(self._fd)
        except OSError as exc:
            self.abort()
            raise self._error(exc, f"writing step {self.step} to {self._root.path}") from None
        os.close(self._fd)
        self._fd = None
        faults.reached("after_fsync_data")

    def commit(self, manifest: bytes) -> None:
        assert self._dir is not None, "draft is closed"
        try:
            data_fd = self._fd  # None once persist() made the data durable (a distributed part)
            if data_fd is not None:
                self._finish()
            fd = self._dir.create_file(MANIFEST_NAME)
            try:
                pos = 0
                while pos < len(manifest):
                    pos += os.write(fd, manifest[pos:])
                # the data, the manifest and the directory's entries, durable before the rename
                _fsync_together([fd, self._dir.fd] + ([data_fd] if data_fd is not None else []))
            finally:
                os.close(fd)
            if data_fd is not None:
                os.close(data_fd)
                self._fd = None
                faults.reached("after_fsync_data")
            faults.reached("after_write_manifest")
            faults.reached("after_fsync_tmp_dir")
            if self._root.exists(self.name):
                raise CheckpointExistsError(f"step {self.step} appeared in {self._root.path} while saving")
            self._root.rename(self.tmp, self.name)
        except CheckpointExistsError:
            self.abort()
            raise
        except OSError as exc:
            self.abort()
            raise self._error(exc, f"committing step {self.step} to {self._root.path}") from None
        except BaseException:
            self.abort()
            raise
        self._close()
        try:  # committed: the step is there; only its durability is in doubt now
            faults.reached("after_rename")
            self._root.fsync()
        except OSError as exc:
            raise StorageError(
                exc.errno,
                f"step {self.step} was committed to {self._root.path} (renamed into place), but making the "
                f"rename durable failed ({exc.strerror or exc}): a power loss could still take the step "
                "away. The step is intact and readable; check the device, and save again under a new step",
            ) from None
        faults.reached("after_fsync_root")

    def abort(self) -> None:
        self._close()
        with contextlib.suppress(OSError):
            self._root.remove(self.tmp)

    def close(self) -> None:
        self._close()

    def _close(self) -> None:
        self._gathered = bytearray()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._dir is not None:
            self._dir.close()
            self._dir = None

    def _error(self, exc: OSError | CrashsafeError, doing: str) -> CrashsafeError:
        if isinstance(exc, OSError) and not isinstance(exc, CrashsafeError):
            return storage_error(exc, doing, self._root.is_current)
        return StorageError(f"{doing}: {exc}")


def _damage(where: str, what: str, exc: Exception) -> CorruptCheckpointError:
    """What opening ``what`` found wrong, as damage of the step: it cannot be read as committed."""
    if isinstance(exc, FileNotFoundError):
        return CorruptCheckpointError(f"{where}: {what} is missing")
    if isinstance(exc, CorruptCheckpointError):
        return CorruptCheckpointError(f"{where}: {exc}")
    strerror = exc.strerror if isinstance(exc, OSError) else None
    return CorruptCheckpointError(f"{where}: {what} cannot be read ({strerror or exc})")
