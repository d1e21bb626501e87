"""Write one step into a temporary directory, then commit it atomically.

The commit protocol (rule 1 of the engine): write payloads -> fsync data -> write and fsync the
manifest -> fsync the temporary directory -> rename it to ``step_<n>`` -> fsync the parent. A crash
at any instant leaves either no new step or a complete one; older steps are never touched.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from crashsafe.codecs.base import BytesLike
from crashsafe.errors import CheckpointExistsError, DiskFullError, StorageError
from crashsafe.format.manifest import MANIFEST_NAME, Manifest, dumps
from crashsafe.storage import faults
from crashsafe.storage.layout import TMP_PREFIX, TRASH_PREFIX, fsync_dir, step_dir, step_name

__all__ = ["DATA_NAME", "StepWriter", "delete_step", "remove_leftovers", "storage_error"]

DATA_NAME = "data.bin"
_CHUNK = 1 << 30
_HASH_ASYNC_MIN = 4 << 20
_HASHER = ThreadPoolExecutor(1, thread_name_prefix="crashsafe-hash")


def storage_error(exc: OSError, doing: str) -> StorageError:
    """Translate an OSError into a crashsafe error that says what to do next."""
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

    def __init__(self, root: Path, step: int) -> None:
        self.root = root
        self.step = step
        self.final = step_dir(root, step)
        if self.final.exists():
            raise CheckpointExistsError(
                f"step {step} is already committed in {root}; committed checkpoints are never "
                "overwritten. Save under a new step, or delete it first with `crashsafe gc`."
            )
        self.tmp = root / f"{TMP_PREFIX}{step_name(step)}-{os.getpid()}-{secrets.token_hex(4)}"
        self._fd: int | None = None
        self.offset = 0
        try:
            os.mkdir(self.tmp)
            faults.reached("after_mkdir_tmp")
            self._fd = os.open(self.tmp / DATA_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            self.abort()
            raise storage_error(exc, f"starting step {step} in {root}") from None

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
            raise storage_error(exc, f"writing step {self.step} to {self.root}") from None
        finally:
            hexdigest = digest.result() if digest is not None else xxhash.xxh3_64_hexdigest(view)
        self.offset += len(view)
        if start == 0 and self.offset > 0:
            faults.reached("mid_data")
        return DATA_NAME, start, len(view), hexdigest

    def commit(self, manifest: Manifest) -> Path:
        """Make the step durable and visible; on any error, remove the temporary directory."""
        assert self._fd is not None, "writer is closed"
        try:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            faults.reached("after_fsync_data")
            fd = os.open(self.tmp / MANIFEST_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                body = dumps(manifest)
                pos = 0
                while pos < len(body):
                    pos += os.write(fd, body[pos:])
                os.fsync(fd)
            finally:
                os.close(fd)
            faults.reached("after_write_manifest")
            fsync_dir(self.tmp)
            faults.reached("after_fsync_tmp_dir")
            if self.final.exists():
                raise CheckpointExistsError(f"step {self.step} appeared in {self.root} while saving")
            os.rename(self.tmp, self.final)
            faults.reached("after_rename")
            fsync_dir(self.root)
            faults.reached("after_fsync_root")
        except OSError as exc:
            if isinstance(exc, CheckpointExistsError):
                self.abort()
                raise
            self.abort()
            raise storage_error(exc, f"committing step {self.step} to {self.root}") from None
        except BaseException:
            self.abort()
            raise
        return self.final

    def abort(self) -> None:
        """Drop the temporary directory (best effort; a leftover is ignored and cleaned later)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        shutil.rmtree(self.tmp, ignore_errors=True)


def delete_step(root: Path, step: int) -> None:
    """Delete a committed step crash-safely: atomically rename it out of view, then remove it."""
    src = step_dir(root, step)
    trash = root / f"{TRASH_PREFIX}{step_name(step)}-{secrets.token_hex(4)}"
    try:
        os.rename(src, trash)
        fsync_dir(root)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise storage_error(exc, f"deleting step {step} in {root}") from None
    faults.reached("after_trash_rename")
    _remove_tree(trash)


def _remove_tree(path: Path) -> None:
    for i, entry in enumerate(sorted(os.listdir(path))):
        os.unlink(path / entry)
        if i == 0:
            faults.reached("mid_delete")
    os.rmdir(path)


def remove_leftovers(paths: list[Path]) -> None:
    """Remove torn saves and half-deleted steps (called by the directory's writer only)."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
