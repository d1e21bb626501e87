"""Count the bytes of checkpoint files this process reads, as the store layer serves them.

Every byte a step reader takes from a store passes through a mapped file's ``populate`` (its views
and the page-cache probe) or a stored file's ``read_into``; both are wrapped, and each file's ranges
are merged, so a byte read twice (probed, then copied) counts once: the count is how much of the
checkpoint's files the process touched. Shared by ``bench.distributed.grow`` and the distributed
tests; crashsafe is imported only when counting starts, so it counts whichever crashsafe the
process runs (the grow bench's ``--src``).
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Reads", "count_reads"]


class Reads:
    """Byte ranges read, per file (a step's data file, as its reader names it)."""

    def __init__(self) -> None:
        self._ranges: dict[str, list[tuple[int, int]]] = {}
        self._lock = threading.Lock()  # restore reads on several threads

    def add(self, file: object, offset: int, nbytes: int) -> None:
        with self._lock:
            name = str(getattr(file, "_what", id(file)))
            self._ranges.setdefault(name, []).append((offset, offset + nbytes))

    def take(self) -> int:
        """Bytes read at least once since the last call, over every file."""
        return sum(self.take_split(""))

    def take_split(self, mark: str) -> tuple[int, int]:
        """Bytes read at least once since the last call: from the files whose name contains
        ``mark`` (a directory: the files of its steps), and from the others."""
        inside, outside = 0, 0
        with self._lock:
            for name, ranges in self._ranges.items():
                total, reach = 0, 0
                for start, stop in sorted(ranges):
                    total += max(0, stop - max(start, reach))
                    reach = max(reach, stop)
                if mark in name:
                    inside += total
                else:
                    outside += total
            self._ranges.clear()
        return inside, outside


def count_reads() -> Reads:
    """Count from now on every byte this process reads from a checkpoint store."""
    from crashsafe.storage import local  # noqa: F401 - defines the local store's file class
    from crashsafe.storage.base import StoredFile
    from crashsafe.storage.mapped import MappedFile

    reads = Reads()
    populate = MappedFile.populate

    def counted_populate(self: MappedFile, offset: int, nbytes: int) -> None:
        reads.add(self, offset, nbytes)
        populate(self, offset, nbytes)

    MappedFile.populate = counted_populate  # type: ignore[method-assign]
    for cls in StoredFile.__subclasses__():
        read_into = cls.read_into

        def counted(self: StoredFile, view: memoryview, offset: int, read_into: Any = read_into) -> None:
            reads.add(self, offset, len(view))
            read_into(self, view, offset)

        cls.read_into = counted  # type: ignore[method-assign]
    return reads
