"""A local step's data files mapped into memory: the fast way to read them, and zero-copy views.

Copying a payload out of a mapping runs at memcpy speed, about 3x faster here than ``preadv`` into
the same memory (bench/results/restore.md), and a checksum can run over a mapping without a copy.
A mapped page that cannot be read (a disk error, a file truncated outside crashsafe) would kill the
process with SIGBUS when touched, so every range is populated first with ``MADV_POPULATE_READ``,
which reports such errors as an OSError instead; where the kernel lacks it (Linux < 5.14), nothing
is mapped and files are read with ``preadv``. Committed files are never truncated: retention
deletes by unlinking, and a mapping stays readable after that (a memory store writes its next step
over a deleted step's file only when no descriptor or mapping of it is left: storage/local.py).

Mapping needs a file descriptor, so only a local step maps (a :class:`StoredFile` with a
``fileno``): the very file the reader opened and checked, so a step deleted, or deleted and saved
again, while it is read still maps the bytes that were committed when it was opened.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
from typing import Any

import numpy as np

from crashsafe.errors import CorruptCheckpointError
from crashsafe.storage.base import StoredFile

__all__ = ["MappedFile", "map_file"]

# madvise(2) option 22 on Linux; Python 3.11's mmap module does not name it yet
_POPULATE_READ: int | None = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform == "linux" else None)
_supported = _POPULATE_READ is not None


class MappedFile:
    """One data file mapped read-only; every read populates its range first (errors, not SIGBUS)."""

    def __init__(self, region: mmap.mmap, what: str) -> None:
        self.region = region
        self._what = what

    def view(self, offset: int, nbytes: int) -> np.ndarray[Any, Any]:
        """The bytes ``offset .. offset + nbytes`` as a read-only array, read from disk if needed."""
        self.populate(offset, nbytes)
        return np.frombuffer(self.region, dtype=np.uint8, count=nbytes, offset=offset)

    def populate(self, offset: int, nbytes: int) -> None:
        """Read the range into the page cache and map it, or raise CorruptCheckpointError."""
        if nbytes == 0:
            return
        start = offset - offset % mmap.PAGESIZE
        assert _POPULATE_READ is not None
        try:
            self.region.madvise(_POPULATE_READ, start, offset + nbytes - start)
        except OSError as exc:
            raise CorruptCheckpointError(
                f"{self._what}: reading bytes {offset}..{offset + nbytes} failed ({exc.strerror or exc}); "
                "the disk may be damaged, or the file was cut short outside crashsafe"
            ) from None


def map_file(file: StoredFile, where: str, size: int) -> MappedFile | None:
    """An opened data ``file`` of a committed step (``size`` bytes, as its manifest says; ``where``
    names it in messages) mapped read-only; None where it cannot be (no file descriptor: another
    store; an empty file; an old kernel)."""
    global _supported
    fd = file.fileno()
    if not (_supported and _POPULATE_READ is not None and fd is not None and size > 0):
        return None
    try:
        if os.fstat(fd).st_size != size:
            return None
        region = mmap.mmap(fd, size, access=mmap.ACCESS_READ)  # holds a file descriptor of its own
    except (OSError, ValueError):
        return None
    try:
        region.madvise(_POPULATE_READ, 0, min(size, mmap.PAGESIZE))
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            _supported = False  # this kernel cannot populate: read with preadv from now on
        return None  # a read error: reading through the store reports it
    return MappedFile(region, where)
