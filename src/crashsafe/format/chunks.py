"""Per-chunk checksums of a raw shard payload, so that a reader can verify a part of it alone.

A payload that is a shard of a DTensor and stored raw (its stored bytes are its array's bytes, C
order) is hashed in chunks of a fixed size, a power of two: chunk ``i`` holds the payload's bytes
``[i * size, (i + 1) * size)``, the last one possibly shorter. The manifest lists every chunk's
xxh3-64, and the payload's own ``xxh3`` is the xxh3-64 of those digests (8 bytes each, big-endian,
in order), so the bytes are hashed once when written, chunk by chunk. A reader that needs a part of
the shard (a rank of a larger world) reads and verifies only the chunks that hold it
(docs/format.md, "Chunk checksums").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from crashsafe.codecs.base import BytesLike

__all__ = [
    "MAX_CHUNK_BYTES", "MIN_CHUNK_BYTES", "Chunks", "chunk_count", "chunk_span", "combine", "hash_chunks",
]  # fmt: skip

MIN_CHUNK_BYTES = 4 << 10  # a multiple of every element size: chunk edges never split an element
MAX_CHUNK_BYTES = 1 << 30


@dataclass(frozen=True)
class Chunks:
    """A payload's chunk size (bytes) and the xxh3-64 (hex) of each of its chunks, in order."""

    size: int
    xxh3: tuple[str, ...]

    def combined(self) -> str:
        """The payload's checksum: the xxh3-64 of the chunks' digests."""
        return combine(self.xxh3)


def chunk_count(nbytes: int, size: int) -> int:
    """How many chunks of ``size`` bytes hold ``nbytes`` bytes (the last may be shorter)."""
    return -(-nbytes // size)


def combine(digests: Sequence[str]) -> str:
    """The xxh3-64 (hex) of chunk digests (hex), each taken as its 8 big-endian bytes."""
    return xxhash.xxh3_64_hexdigest(b"".join(bytes.fromhex(d) for d in digests))


def hash_chunks(data: BytesLike, size: int) -> Chunks:
    """The chunk checksums of ``data``: one pass over its bytes, as a whole-payload xxh3 would be."""
    view = memoryview(data).cast("B")
    digests = tuple(xxhash.xxh3_64_hexdigest(view[i : i + size]) for i in range(0, len(view), size))
    return Chunks(size, digests)


def chunk_span(start: int, stop: int, size: int) -> tuple[int, int]:
    """The chunks ``[first, end)`` that hold bytes ``[start, stop)`` of a payload (none if empty)."""
    if stop <= start:
        return start // size, start // size
    return start // size, chunk_count(stop, size)
