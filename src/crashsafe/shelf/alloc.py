"""First-fit allocator over the arena's data region, rebuilt from the metadata on open.

It keeps no state on disk of its own: a block is in use iff the committed metadata (or the
transaction in progress) points at it, so a crash can never leak or double-book a block.
"""

from __future__ import annotations

import bisect

from crashsafe.shelf.layout import ALIGN

__all__ = ["Allocator", "reserved"]


def reserved(nbytes: int) -> int:
    """Bytes a block of ``nbytes`` occupies: at least one 64-byte line, 64-byte aligned."""
    return -(-max(nbytes, 1) // ALIGN) * ALIGN


class Allocator:
    """Sorted, non-overlapping used blocks in ``[start, end)``; ``alloc`` returns the first gap."""

    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.end = end
        self._offsets: list[int] = []
        self._sizes: dict[int, int] = {}

    def mark(self, offset: int, nbytes: int) -> None:
        """Record a block as used (rebuilding from metadata)."""
        self._sizes[offset] = reserved(nbytes)
        bisect.insort(self._offsets, offset)

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new block of ``nbytes``, or None if no gap is large enough."""
        need = reserved(nbytes)
        cursor = self.start
        for offset in self._offsets:
            if offset - cursor >= need:
                break
            cursor = max(cursor, offset + self._sizes[offset])
        if self.end - cursor < need:
            return None
        self.mark(cursor, need)
        return cursor

    def release(self, offset: int) -> None:
        del self._sizes[offset]
        self._offsets.pop(bisect.bisect_left(self._offsets, offset))

    @property
    def used(self) -> int:
        return sum(self._sizes.values())

    def largest_gap(self) -> int:
        """The biggest block ``alloc`` could return now."""
        best, cursor = 0, self.start
        for offset in self._offsets:
            best = max(best, offset - cursor)
            cursor = max(cursor, offset + self._sizes[offset])
        return max(best, self.end - cursor)
