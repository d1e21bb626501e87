"""fsspec's local file system (``file://`` URLs), safe in a directory that others can write.

fsspec opens files by name, following links: a FIFO where the lease or a manifest belongs makes an
open wait forever for a writer, and a ``.lock`` linked to another file is truncated through the
link. It reports a link with its target's size; its "create" checks, then opens, so that two
writers can both create one manifest; and it never fsyncs, where the manifest-last commit needs
each write durable once acknowledged, as an object store's is. fsspec has no option for any of
this, hence this subclass. Writes are fsynced, with the directory that names them. A file is opened
relative to its directory, which must not be a link, without following a link itself; anything but
a regular file is refused (UnsafeEntryError); a create is one ``O_EXCL`` open; and a link is listed
as what it is (a link, of size 0, never entered). So a step directory that is a link is neither
read, written nor deleted through. (The location's root was resolved once, when opened: the user
chose it, links and all.)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from typing import Any, BinaryIO

from fsspec.implementations.local import LocalFileSystem

from crashsafe.storage.localdir import UnsafeEntryError

__all__ = ["SafeLocalFileSystem"]

_FLAGS = {
    "rb": os.O_RDONLY,
    "wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "xb": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
}
_SAFE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # O_NONBLOCK: a FIFO opens (or fails) at once
_UNSAFE_ERRNOS = frozenset({errno.ELOOP, errno.ENXIO})  # a link; a FIFO without a reader


class SafeLocalFileSystem(LocalFileSystem):  # type: ignore[misc]  # fsspec has no type hints
    """``LocalFileSystem`` that opens regular files only, never through a link."""

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> BinaryIO:
        path = self._strip_protocol(path)
        if mode not in _FLAGS:
            raise ValueError(f"{mode!r}: only binary reads, writes and creates are supported")
        if self.auto_mkdir and mode != "rb":
            self.makedirs(self._parent(path), exist_ok=True)
        with _directory_of(path) as (folder, name):
            return _open_regular(folder, name, mode, path)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        """Write ``value`` to ``path``, durably before returning (the file, then the directory that
        names it), as an object store acknowledges a write: the manifest-last commit counts on it.
        ``mode="create"`` fails with FileExistsError, atomically, if anything is there."""
        path = self._strip_protocol(path)
        with _directory_of(path) as (folder, name):
            with _open_regular(folder, name, "xb" if mode == "create" else "wb", path) as file:
                file.write(value)
                file.flush()
                os.fsync(file.fileno())
            os.fsync(folder)

    def rm_file(self, path: str) -> None:
        """Remove the entry ``path`` itself (a link, not its target), never through a linked directory."""
        with _directory_of(self._strip_protocol(path)) as (folder, name):
            os.unlink(name, dir_fd=folder)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Create the directory ``path``, durably (its parent is fsynced); one that exists must be a
        directory, not a link to one."""
        path = self._strip_protocol(path)
        existed = os.path.lexists(path)
        super().makedirs(path, exist_ok=exist_ok)
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise UnsafeEntryError(f"{path} is a link or a file where a directory belongs; remove it")
        if not existed:
            with _directory_of(path) as (folder, _):
                os.fsync(folder)

    def info(self, path: Any, **kwargs: Any) -> dict[str, Any]:
        """fsspec's entry, but a link is a link: of type "other" and size 0, whatever it points to."""
        if not isinstance(path, os.DirEntry):  # (an entry of a listing is in a directory listed)
            with _directory_of(self._strip_protocol(path)):
                pass
        try:
            out: dict[str, Any] = super().info(path, **kwargs)
        except FileNotFoundError:  # a dangling link (fsspec follows it) is still an entry
            name = self._strip_protocol(path.path if isinstance(path, os.DirEntry) else path)
            if not os.path.islink(name):
                raise
            out = {"name": name, "islink": True, "mtime": os.lstat(name).st_mtime}
        if out.get("islink"):
            out.update(type="other", size=0)
        return out


def _open_regular(folder: int, name: str, mode: str, path: str) -> BinaryIO:
    """The regular file ``name`` of the directory ``folder`` opened in ``mode`` (never a link, never
    waiting for a FIFO); UnsafeEntryError for anything else."""
    try:
        fd = os.open(name, _FLAGS[mode] | _SAFE, 0o666, dir_fd=folder)
    except OSError as exc:
        if exc.errno in _UNSAFE_ERRNOS:
            raise _unsafe(path) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _unsafe(path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return open(fd, "rb" if mode == "rb" else "wb", closefd=True)  # the caller closes it
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def _directory_of(path: str) -> Iterator[tuple[int, str]]:
    """An fd of the directory holding ``path`` (opened without following a link) and the name in it."""
    folder, name = os.path.split(path)
    try:
        fd = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeEntryError(
                f"{folder} is a link or a file where a directory belongs: crashsafe never reads, writes or "
                "deletes through one. Remove it"
            ) from None
        raise
    try:
        yield fd, name
    finally:
        os.close(fd)


def _unsafe(path: str) -> UnsafeEntryError:
    return UnsafeEntryError(
        f"{path} is a link, FIFO, device or socket, not a regular file: crashsafe never reads or writes "
        "through one. Remove it"
    )
