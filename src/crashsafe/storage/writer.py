"""Write one step into a temporary directory, then commit it atomically.

The commit protocol (rule 1 of the engine): write payloads -> fsync data -> validate the manifest
with the reader's own validator, write and fsync it -> fsync the temporary directory -> rename it
to ``step_<n>`` -> fsync the parent. A crash at any instant leaves either no new step or a complete
one; older steps are never touched. Every name is resolved relative to the held checkpoint
directory without following links (see :mod:`crashsafe.storage.localdir`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import xxhash

import crashsafe._faults as faults
from crashsafe.codecs.base import BytesLike
from crashsafe.errors import (
    CheckpointExistsError,
    CrashsafeError,
    DiskFullError,
    StorageError,
    UnsupportedStateError,
)
from crashsafe.format.manifest import MANIFEST_NAME, Manifest, dumps, loads
from crashsafe.storage.layout import TMP_PREFIX, TRASH_PREFIX, step_name
from crashsafe.storage.localdir import LocalDir

__all__ = ["DATA_NAME", "StepWriter", "delete_step", "delete_steps", "remove_leftovers", "storage_error"]

DATA_NAME = "data.bin"
_CHUNK = 1 << 30
_HASH_ASYNC_MIN = 4 << 20
_HASHER = ThreadPoolExecutor(1, thread_name_prefix="crashsafe-hash")


def storage_error(exc: OSError, doing: str, root: LocalDir | None = None) -> StorageError:
    """Translate an OSError into a crashsafe error that says what to do next.

    With ``root``, first check that the checkpoint directory is still there: if it was deleted or
    replaced, that is the error to report (its committed steps are gone from its path).
    """
    if root is not None and not root.is_current():
        return StorageError(
            errno.ENOENT,
            f"the checkpoint directory {root.path} was deleted or replaced while {doing}; nothing "
            "was written there and the steps it held are gone from that path. Find out what removed "
            "it, then create a new CheckpointManager",
        )
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(
            exc.errno,
            f"no space left on the device while {doing}. Free space or "
            "lower keep_last; committed checkpoints are intact",
        )
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return StorageError(
            exc.errno,
            f"permission denied while {doing} ({exc.strerror}). Make the "
            "checkpoint directory writable; committed checkpoints are intact",
        )
    return StorageError(
        exc.errno, f"I/O error while {doing}: {exc.strerror or exc}. Committed checkpoints are intact"
    )


class StepWriter:
    """Payloads of one step go into ``.tmp-*``; :meth:`commit` makes them a step, or nothing."""

    def __init__(self, root: LocalDir, step: int) -> None:
        self.root = root
        self.step = step
        self.name = step_name(step)
        if root.exists(self.name):
            raise CheckpointExistsError(
                f"step {step} is already committed in {root.path}; committed checkpoints are never "
                "overwritten. Save under a new step, or delete it first with `crashsafe gc`."
            )
        self.tmp = f"{TMP_PREFIX}{self.name}-{os.getpid()}-{secrets.token_hex(4)}"
        self._dir: LocalDir | None = None
        self._fd: int | None = None
        self.offset = 0
        try:
            root.mkdir(self.tmp)
            faults.reached("after_mkdir_tmp")
            self._dir = root.subdir(self.tmp)
            self._fd = self._dir.create_file(DATA_NAME)
        except (OSError, CrashsafeError) as exc:
            self.abort()
            raise self._error(exc, f"starting step {step} in {root.path}") from None

    def write_payload(self, data: BytesLike) -> tuple[str, int, int, str]:
        """Append one encoded payload; return (file, offset, nbytes, xxh3 hex)."""
        assert self._fd is not None, "writer is closed"
        view = memoryview(data).cast("B")
        # hash on another core while this one writes (both release the GIL)
        digest = _HASHER.submit(xxhash.xxh3_64_hexdigest, view) if len(view) > _HASH_ASYNC_MIN else None
        start = self.offset
        try:
            pos = 0
            while pos < len(view):
                pos += os.write(self._fd, view[pos : pos + _CHUNK])
        except OSError as exc:
            raise self._error(exc, f"writing step {self.step} to {self.root.path}") from None
        finally:
            hexdigest = digest.result() if digest is not None else xxhash.xxh3_64_hexdigest(view)
        self.offset += len(view)
        if start == 0 and self.offset > 0:
            faults.reached("mid_data")
        return DATA_NAME, start, len(view), hexdigest

    def commit(self, manifest: Manifest) -> None:
        """Make the step durable and visible; on any error, remove the temporary directory.

        The manifest goes through the reader's validator first: a step that would not load back
        is never committed (rule 10).
        """
        assert self._fd is not None and self._dir is not None, "writer is closed"
        try:
            body = dumps(manifest)
            loads(body, f"the manifest of step {self.step}")
        except (ValueError, TypeError) as exc:  # CorruptCheckpointError is a ValueError
            self.abort()
            raise UnsupportedStateError(
                f"step {self.step} was not committed because it would not load back: {exc}. "
                "Committed checkpoints are intact"
            ) from None
        try:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            faults.reached("after_fsync_data")
            fd = self._dir.create_file(MANIFEST_NAME)
            try:
                pos = 0
                while pos < len(body):
                    pos += os.write(fd, body[pos:])
                os.fsync(fd)
            finally:
                os.close(fd)
            faults.reached("after_write_manifest")
            self._dir.fsync()
            faults.reached("after_fsync_tmp_dir")
            if self.root.exists(self.name):
                raise CheckpointExistsError(f"step {self.step} appeared in {self.root.path} while saving")
            self.root.rename(self.tmp, self.name)
            faults.reached("after_rename")
            self.root.fsync()
            faults.reached("after_fsync_root")
        except CheckpointExistsError:
            self.abort()
            raise
        except OSError as exc:
            self.abort()
            raise self._error(exc, f"committing step {self.step} to {self.root.path}") from None
        except BaseException:
            self.abort()
            raise
        self._close()

    def _error(self, exc: OSError | CrashsafeError, doing: str) -> CrashsafeError:
        if isinstance(exc, OSError) and not isinstance(exc, CrashsafeError):
            return storage_error(exc, doing, self.root)
        return StorageError(f"{doing}: {exc}")

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._dir is not None:
            self._dir.close()
            self._dir = None

    def abort(self) -> None:
        """Drop the temporary directory (best effort; a leftover is ignored and cleaned later)."""
        self._close()
        with contextlib.suppress(OSError):
            self.root.remove(self.tmp)


def delete_step(root: LocalDir, step: int) -> None:
    """Delete a committed step crash-safely: atomically rename it out of view, then remove it.

    The step's entry is renamed and removed without following links: a ``step_*`` that is a
    symlink loses the link, never the files it points to.
    """
    trash = f"{TRASH_PREFIX}{step_name(step)}-{secrets.token_hex(4)}"
    try:
        root.rename(step_name(step), trash)
        root.fsync()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise storage_error(exc, f"deleting step {step} in {root.path}", root) from None
    faults.reached("after_trash_rename")
    try:
        root.remove(trash, after_first=lambda: faults.reached("mid_delete"))
    except OSError as exc:
        raise storage_error(exc, f"removing deleted step {step} from {root.path}", root) from None


def delete_steps(root: LocalDir, steps: Iterable[int]) -> None:
    """Delete steps newest first: a delta step always goes before the base it needs, so a crash
    in between never leaves a step whose base is gone (delta bases are always earlier steps)."""
    for step in sorted(set(steps), reverse=True):
        delete_step(root, step)


def remove_leftovers(root: LocalDir, names: list[str]) -> None:
    """Remove torn saves and half-deleted steps (called by the directory's writer only)."""
    for name in names:
        with contextlib.suppress(OSError):
            root.remove(name)
