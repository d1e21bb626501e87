"""The arena file on disk: atomic creation, exclusive lock, memory mapping and durability.

Durability levels (what a committed transaction survives):

- ``process``: stores into a shared file mapping sit in the kernel's page cache the moment they
  execute, so a killed process loses nothing it committed. No flush is issued. Survives crashes of
  the process, not of the machine. The right level for ``/dev/shm`` (RAM: a power loss wipes it).
- ``power``: ``fdatasync`` (equivalent to ``msync`` of every dirty range) at every ordering point of
  the commit protocol, so a committed transaction survives an OS crash or power loss on a disk
  filesystem.
- On a DAX filesystem (persistent memory, mounted with ``-o dax``) the file is mapped with
  ``MAP_SYNC`` when the kernel allows it, so the filesystem's own metadata for each page is durable
  when the page is first written; the ordering points still call ``fdatasync``, which on DAX writes
  the CPU caches back (Python cannot issue the cache-flush instructions a C library would).
``auto`` picks ``process`` on tmpfs/ramfs and ``power`` elsewhere.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
import weakref
from pathlib import Path
from typing import Literal

from crashsafe.errors import LockedError
from crashsafe.shelf.errors import NotAShelfError, ShelfError, ShelfFullError
from crashsafe.shelf.layout import PAGE, Superblock

__all__ = ["Arena", "Durability", "mount_of", "open_regular"]

Durability = Literal["auto", "process", "power"]
_MAP_SHARED_VALIDATE = 0x03
_MAP_SYNC = 0x80000
_RAM_FILESYSTEMS = ("tmpfs", "ramfs")


def mount_of(path: Path) -> tuple[str, str]:
    """(filesystem type, mount options) of the mount holding ``path`` (from /proc/self/mounts)."""
    target = os.path.realpath(path)
    best = ("", "", "")
    with contextlib.suppress(OSError), open("/proc/self/mounts") as mounts:
        for line in mounts:
            parts = line.split()
            if len(parts) < 4:
                continue
            point = parts[1].replace("\\040", " ")
            inside = target == point or target.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best[0]):
                best = (point, parts[2], parts[3])
    return best[1], best[2]


def open_regular(path: Path, flags: int) -> int:
    """An fd of the regular file at ``path`` (links followed: the user chose the path). A FIFO,
    device or socket is refused without waiting (an open of a FIFO waits for its other end)."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotAShelfError(
            f"{path} is not a crashsafe shelf: it is not a regular file (a FIFO, a device or a socket). "
            "Choose another path"
        )
    return fd


class Arena:
    """An open, locked, mapped arena file; ``sync`` is its ordering point per ``durability``."""

    def __init__(self, path: Path, fd: int, durability: Literal["process", "power"]) -> None:
        self.path = path
        self.fd = fd
        self.durability = durability
        self.length = os.fstat(fd).st_size
        self.map_sync = False
        self.mm = self._map()
        self.closed = False
        self._close_fd = weakref.finalize(self, os.close, fd)  # an unclosed shelf still unlocks on GC

    @classmethod
    def open(cls, path: Path, durability: Durability) -> Arena:
        """Open an existing arena for writing, taking its exclusive lock."""
        try:
            fd = open_regular(path, os.O_RDWR)
        except OSError as exc:
            raise ShelfError(f"cannot open the shelf {path}: {exc.strerror}. Check the path and "
                             "its permissions") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LockedError(
                f"the shelf {path} is open in another process (one writer at a time). Close it "
                "there first, or use another path."
            ) from None
        if os.fstat(fd).st_size < PAGE:
            os.close(fd)
            raise NotAShelfError(
                f"{path} is not a crashsafe shelf: it is shorter than one page. Choose another "
                "path, or delete the file if it is a leftover."
            )
        fstype, _ = mount_of(path)
        level: Literal["process", "power"] = durability if durability != "auto" else (
            "process" if fstype in _RAM_FILESYSTEMS else "power")
        try:
            return cls(path, fd, level)
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def create(path: Path, size: int, head: list[tuple[int, bytes]]) -> None:
        """Create ``path`` atomically: a preallocated temp file with ``head`` written, then rename."""
        tmp = path.with_name(f".{path.name}.creating-{os.getpid()}")
        try:  # a new file of our own: never through a link (say, planted in /dev/shm), never a FIFO
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # what a killed creation of this pid left
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ShelfError(f"cannot create the shelf {path}: {exc.strerror}. Check that the "
                             "directory exists and is writable") from None
        try:
            Arena._allocate(fd, 0, size, path)
            for offset, data in head:
                os.pwrite(fd, data, offset)
            os.fsync(fd)
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)  # unlike rename, never replaces a shelf created meanwhile
            os.unlink(tmp)
            dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)

    @staticmethod
    def _allocate(fd: int, offset: int, length: int, path: Path) -> None:
        """Reserve the file's blocks now so that a full disk is an error here, not a SIGBUS later."""
        try:
            os.posix_fallocate(fd, offset, length)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise ShelfFullError(
                    f"no space for a {length}-byte shelf region at {path}: {exc.strerror}. Free space "
                    "or choose a smaller size="
                ) from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, offset + length)

    def _map(self) -> mmap.mmap:
        # mmap keeps a dup of the descriptor it is given; mapping through a second open of the
        # file keeps that dup off the locked open file, so close() unlocks even while user views
        # keep the mapping alive
        fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDWR | os.O_CLOEXEC)  # the locked file, not the path's
        try:
            _, options = mount_of(self.path)
            if "dax" in options.split(","):
                try:
                    mapped = mmap.mmap(fd, self.length, flags=_MAP_SHARED_VALIDATE | _MAP_SYNC)
                except OSError:
                    pass
                else:
                    self.map_sync = True
                    return mapped
            return mmap.mmap(fd, self.length, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)

    def grow(self, size: int) -> None:
        """Extend the file to ``size`` bytes (before anything is mapped out of it) and remap."""
        self.mm.close()
        Arena._allocate(self.fd, self.length, size - self.length, self.path)
        self.length = size
        self.mm = self._map()

    def read_superblock(self) -> Superblock:
        return Superblock.unpack(self.mm[:PAGE], self.path)

    def sync(self) -> None:
        """An ordering point: every store made so far is durable when this returns.

        At ``power`` durability this is one ``fdatasync`` of the file, which on Linux writes back the
        pages dirtied through the mapping too (one call, instead of an ``msync`` per range); at
        ``process`` durability it is a no-op."""
        if self.durability == "power":
            os.fdatasync(self.fd)

    def close(self) -> None:
        """Unmap (unless views are still alive: then the mapping dies with them) and unlock."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(BufferError):  # user-held views keep the mapping alive
            self.mm.close()
        self._close_fd()
