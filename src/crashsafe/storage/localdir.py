"""A directory held open by file descriptor; every entry in it is reached without following links.

A checkpoint directory may hold hostile entries: a ``step_*`` symlinked to another run, a
``.lock`` symlinked to a system file, a FIFO where a manifest belongs. Opening entries by name
relative to a held directory fd with ``O_NOFOLLOW``, and checking what was opened with ``fstat``
before using it, keeps crashsafe inside the directory (design rule 11): it never reads, writes or deletes
through a link and never blocks on a FIFO. Holding the fd also tells a writer when its directory
was deleted or replaced under it (:meth:`LocalDir.is_current`).

Only the root is opened by path, following links: that is the user's own choice of location.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from crashsafe._closing import Closing
from crashsafe.errors import CorruptCheckpointError

__all__ = ["LocalDir", "UnsafeEntryError"]

_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeEntryError(CorruptCheckpointError):
    """An entry is a link, FIFO, device or socket, or a file where a directory belongs (or back)."""


class LocalDir(Closing):
    """An open directory. Children are opened relative to it; links are never followed."""

    def __init__(self, path: Path, fd: int, absolute: str | None = None) -> None:
        self.path = path  # as the user gave it (for messages)
        self.fd = fd
        # where it is, whatever the working directory becomes: a relative path opened before an
        # os.chdir names another place after it (is_current)
        self._absolute = os.path.abspath(path) if absolute is None else absolute
        st = os.fstat(fd)
        self._identity = (st.st_dev, st.st_ino)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> LocalDir:
        """Open the directory at ``path`` (which may itself be a link: the user chose it)."""
        absolute = os.path.abspath(path)
        fd = os.open(absolute, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        return cls(Path(path), fd, absolute)

    # ------------------------------------------------------------------------- opening

    def subdir(self, name: str) -> LocalDir:
        """The child directory ``name``; UnsafeEntryError if it is a link or not a directory."""
        try:
            fd = os.open(name, _DIR, dir_fd=self.fd)
        except OSError as exc:
            raise self._unsafe(name, exc) from None
        return LocalDir(self.path / name, fd, os.path.join(self._absolute, name))

    def open_file(self, name: str) -> int:
        """A read-only fd of the regular file ``name`` (the caller closes it)."""
        return self._open_regular(name, _READ)  # O_NONBLOCK: a FIFO opens at once, then is refused

    def read_file(self, name: str, limit: int) -> bytes:
        """Up to ``limit`` bytes of the regular file ``name``."""
        fd = self.open_file(name)
        try:
            chunks = []
            left = limit
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 24))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def create_file(self, name: str) -> int:
        """A write-only fd of a new regular file ``name``; fails if anything named so exists."""
        return os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=self.fd
        )

    def open_lock_file(self, name: str) -> int:
        """A read-write fd of the regular file ``name``, created if missing (never through a link)."""
        return self._open_regular(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)

    def _open_regular(self, name: str, flags: int) -> int:
        """Open ``name`` with ``flags`` (which never follow a link) and check it is a regular file."""
        try:
            fd = os.open(name, flags, 0o644, dir_fd=self.fd)
        except OSError as exc:
            raise self._unsafe(name, exc) from None
        try:
            self._require_regular(name, os.fstat(fd).st_mode)
        except BaseException:
            os.close(fd)
            raise
        return fd

    # ------------------------------------------------------------------------- entries

    def names(self) -> list[str]:
        """Names of the entries in this directory."""
        return os.listdir(self.fd)

    def exists(self, name: str) -> bool:
        """Whether an entry ``name`` exists (a link counts, whatever it points to)."""
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def entry_identity(self, name: str) -> tuple[int, int] | None:
        """(device, inode) of the entry ``name`` itself, or None if there is none."""
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    @property
    def identity(self) -> tuple[int, int]:
        """(device, inode) of this directory."""
        return self._identity

    def mkdir(self, name: str) -> None:
        os.mkdir(name, 0o755, dir_fd=self.fd)

    def rename(self, src: str, dst: str) -> None:
        """Rename an entry within this directory (atomic)."""
        os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def fsync(self) -> None:
        """Make this directory's entries (creations, renames, deletions) durable."""
        os.fsync(self.fd)

    def remove(self, name: str, after_first: Callable[[], None] | None = None) -> None:
        """Delete the entry ``name``: a link or file is unlinked (never its target); a directory is
        emptied without following links inside it, then removed. ``after_first`` runs after the
        first entry of a directory is unlinked (a kill point for tests)."""
        try:
            sub = self.subdir(name)
        except UnsafeEntryError:  # a link, file, FIFO...: remove the entry itself
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=self.fd)
            return
        except FileNotFoundError:
            return
        with sub:
            for i, child in enumerate(sorted(sub.names())):
                try:
                    os.unlink(child, dir_fd=sub.fd)
                except IsADirectoryError:
                    shutil.rmtree(child, dir_fd=sub.fd)  # fd-based: never follows links
                if i == 0 and after_first is not None:
                    after_first()
        os.rmdir(name, dir_fd=self.fd)

    # ------------------------------------------------------------------------- lifecycle

    def is_current(self) -> bool:
        """True while this directory still exists at its path (not deleted, moved or replaced)."""
        try:
            if os.fstat(self.fd).st_nlink == 0:
                return False
            st = os.stat(self._absolute)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._identity

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # ------------------------------------------------------------------------- refusals

    def _unsafe(self, name: str, exc: OSError) -> Exception:
        """Translate a refused open into an error naming what the entry really is."""
        if exc.errno not in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR, errno.EISDIR):
            return exc
        try:
            mode = os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode
        except OSError:
            return exc
        if stat.S_ISLNK(mode):
            return UnsafeEntryError(
                f"{self.path / name} is a symbolic link; crashsafe never follows links inside a checkpoint "
                "directory (they could lead to another run or a system file). Replace it with the real "
                "file or directory"
            )
        wanted = "a directory" if exc.errno == errno.ENOTDIR else "a regular file"
        return UnsafeEntryError(f"{self.path / name} is {_kind(mode)}, not {wanted}")

    def _require_regular(self, name: str, mode: int) -> None:
        if not stat.S_ISREG(mode):
            raise UnsafeEntryError(
                f"{self.path / name} is {_kind(mode)}, not a regular file; crashsafe reads only regular "
                "files in a checkpoint directory"
            )


def _kind(mode: int) -> str:
    """What a file mode describes, in words."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "a device or socket"
