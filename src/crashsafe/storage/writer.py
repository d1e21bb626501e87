"""Write one step to any store: checksum payloads as they go, validate the manifest, commit.

The store's :class:`~crashsafe.storage.base.Draft` moves the bytes and runs its own commit
protocol (rename for directories, manifest-last for object stores). What holds for every store is
here: each payload's xxh3 is computed on another core while it is written, and the manifest goes
through the reader's own validator before the commit, so a step that would not load back is never
committed (docs/design.md, rule 10).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import xxhash

import crashsafe._faults as faults
from crashsafe._runtime import pool
from crashsafe.codecs.base import BytesLike
from crashsafe.errors import UnsupportedStateError
from crashsafe.format.chunks import Chunks, hash_chunks
from crashsafe.format.manifest import Manifest, check_written, dumps
from crashsafe.storage.base import Store

__all__ = ["StepWriter", "Written", "delete_steps"]

_HASH_ASYNC_MIN = 4 << 20


@dataclass(frozen=True)
class Written:
    """Where :meth:`StepWriter.write_payload` put a payload, and its checksum (and chunks')."""

    file: str
    offset: int
    nbytes: int
    xxh3: str
    chunks: Chunks | None = None


def _hash(view: memoryview, chunk: int | None) -> str | Chunks:
    """The checksum of a payload's bytes: its xxh3, or its chunks' (``chunk`` bytes each)."""
    return xxhash.xxh3_64_hexdigest(view) if chunk is None else hash_chunks(view, chunk)


class StepWriter:
    """Payloads of one step go into the store's draft; :meth:`commit` makes them a step, or nothing."""

    def __init__(
        self, store: Store, step: int, *, attempt: str | None = None, part: str | None = None
    ) -> None:
        self.step = step
        self._draft = store.begin(step, attempt=attempt, part=part)
        self._first = True
        self._committed = False

    def write_payload(
        self, data: BytesLike, hashed: str | Chunks | None = None, chunk: int | None = None
    ) -> Written:
        """Append one encoded payload; return where it went and its checksum. ``chunk``: hash it in
        chunks of that many bytes (a raw shard: docs/format.md, "Chunk checksums"). ``hashed``: the
        checksum the caller already computed over these very bytes (not hashed again), its xxh3
        hex or, for a payload hashed in chunks, its Chunks."""
        view = memoryview(data).cast("B")
        if isinstance(hashed, str) and chunk is not None:
            raise ValueError("a payload hashed in chunks needs its chunks' checksums, not one xxh3")
        # hash on another core while this one writes (both release the GIL)
        in_parallel = hashed is None and len(view) > _HASH_ASYNC_MIN
        digest = pool("hash", 1).submit(_hash, view, chunk) if in_parallel else None
        try:
            file, offset = self._draft.write(view)
        finally:
            if hashed is None:
                hashed = digest.result() if digest is not None else _hash(view, chunk)
        if self._first and len(view) > 0:
            self._first = False
            faults.reached("mid_data")
        if isinstance(hashed, Chunks):
            return Written(file, offset, len(view), hashed.combined(), hashed)
        return Written(file, offset, len(view), hashed)

    def files(self) -> dict[str, int]:
        """The data files written so far and their sizes (the manifest's file table)."""
        return self._draft.files()

    def commit(self, manifest: Manifest) -> None:
        """Validate the manifest as a reader would, then make the step durable and visible."""
        try:
            body = dumps(manifest)
            check_written(body, f"the manifest of step {self.step}")
        except (ValueError, TypeError) as exc:  # CorruptCheckpointError is a ValueError
            self.abort()
            raise UnsupportedStateError(
                f"step {self.step} was not committed because it would not load back: {exc}. "
                "Committed checkpoints are intact"
            ) from None
        self._draft.commit(body)
        self._committed = True

    def persist(self) -> None:
        """Make this writer's part durable without committing it (a rank of a distributed step)."""
        self._draft.persist()

    def close(self) -> None:
        """Release the writer, keeping what it persisted (rank 0 commits the distributed step)."""
        self._draft.close()

    def abort(self) -> None:
        """Drop the step (best effort: a leftover is invisible and cleaned later); once committed,
        nothing: an error after the commit (a rank that never heard the outcome) leaves the step."""
        if not self._committed:
            self._draft.abort()


def delete_steps(store: Store, steps: Iterable[int]) -> None:
    """Delete steps newest first: a delta step always goes before the base it needs, so a crash
    in between never leaves a step whose base is gone (delta bases are always earlier steps)."""
    for step in sorted(set(steps), reverse=True):
        store.delete(step)
