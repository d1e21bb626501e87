"""What a checkpoint store is: where a run's steps live, and the protocol that commits one.

A store moves bytes (rule 14 of docs/design.md): it lists committed steps, reads byte ranges of a
committed step's files, writes a new step's files and commits them, and deletes steps. It never
decodes: manifest validation, checksums, codecs and delta chains live above it
(``storage/reader.py``, ``storage/writer.py``, ``chain.py``), so a new backend is a small class.
Its :class:`Capabilities` say what its commit protocol can promise.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from crashsafe._closing import Closing
from crashsafe.codecs.base import BytesLike

__all__ = ["Capabilities", "Draft", "Lock", "Store", "StoredFile", "StoredStep"]


@dataclass(frozen=True)
class Capabilities:
    """What a store's commit protocol rests on.

    Attributes:
        atomic_rename: a step appears by one atomic rename of a finished temporary directory
            (local file systems); otherwise by writing its manifest last (object stores).
        conditional_put: a step's manifest is created only if absent, atomically (S3's
            ``If-None-Match``), so two writers can never both commit one step.
        durable_fsync: writes become durable by ``fsync`` (local files); otherwise a write is durable
            when the store acknowledges it.
    """

    atomic_rename: bool
    conditional_put: bool
    durable_fsync: bool


class StoredFile(ABC):
    """One data file of a committed step, read by byte range."""

    size: int

    @abstractmethod
    def read_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the file's bytes from ``offset`` (CorruptCheckpointError if they end)."""

    def fileno(self) -> int | None:
        """The open file's descriptor, where it has one (a local file: it can be mapped), else None."""
        return None

    def close(self) -> None:
        """Release what reading held (a file descriptor, a connection)."""
        return None  # nothing to do, unless a subclass says otherwise


class StoredStep(Closing, ABC):
    """A committed step opened for reading."""

    step: int
    where: str  # for messages: "checkpoint step 12 (/ckpt/step_000000000012)"

    @abstractmethod
    def manifest_bytes(self, limit: int) -> bytes:
        """Up to ``limit`` bytes of the step's manifest (CorruptCheckpointError if it is missing)."""

    @abstractmethod
    def open_file(self, name: str) -> StoredFile:
        """A data file of the step (CorruptCheckpointError if it is missing or not a regular file)."""

    @abstractmethod
    def vanished(self) -> bool:
        """True if this step was deleted (or replaced) since it was opened: then errors reading it
        are not damage."""

    def close(self) -> None:
        """Release what the open step held."""
        return None  # nothing to do, unless a subclass says otherwise


class Draft(ABC):
    """A step being written: payloads go in, then :meth:`commit` makes it a step, or nothing."""

    @abstractmethod
    def write(self, data: BytesLike) -> tuple[str, int]:
        """Append one payload; return (file name, offset)."""

    @abstractmethod
    def files(self) -> dict[str, int]:
        """Every data file written so far and its size (the manifest's file table)."""

    @abstractmethod
    def persist(self) -> None:
        """Make what this draft wrote durable, without committing: in a distributed step every rank
        persists its part, then rank 0 commits the whole."""

    @abstractmethod
    def commit(self, manifest: bytes) -> None:
        """Make the step durable and visible with ``manifest`` (already validated), or raise and
        leave nothing visible."""

    @abstractmethod
    def abort(self) -> None:
        """Drop what was written (best effort: a leftover is invisible and cleaned later)."""

    def close(self) -> None:
        """Release what the draft holds, keeping what it wrote (a rank whose part rank 0 commits)."""
        return None  # nothing to do, unless a subclass says otherwise


class Lock(ABC):
    """The one-writer lock of a store."""

    @abstractmethod
    def release(self) -> None: ...

    def check(self) -> None:
        """Raise LockedError if the lock was lost (a lease that expired and was taken over)."""
        return None  # nothing to do, unless a subclass says otherwise


class Store(ABC):
    """Where a run's checkpoints live: a local directory, an object-store prefix, ..."""

    capabilities: Capabilities
    location: str  # for messages

    @abstractmethod
    def steps(self) -> list[int]:
        """Committed steps, ascending."""

    def has_step(self, step: int) -> bool:
        """Whether ``step`` is committed: what ``step in steps()`` says, cheaper where a backend
        can check one name (a save asks it on the training thread)."""
        return step in self.steps()

    @abstractmethod
    def open_step(self, step: int) -> StoredStep:
        """A committed step for reading (NoCheckpointError if it is not committed)."""

    @abstractmethod
    def begin(self, step: int, *, attempt: str | None = None, part: str | None = None) -> Draft:
        """Start writing ``step`` (CheckpointExistsError if it is committed). Ranks writing one
        distributed step share its ``attempt`` (one temporary place) and each writes its ``part``."""

    @abstractmethod
    def delete(self, step: int) -> None:
        """Delete a committed step crash-safely: first out of view, then its bytes."""

    @abstractmethod
    def leftovers(self) -> list[str]:
        """Names of what torn saves and interrupted deletions left (invisible to readers)."""

    @abstractmethod
    def remove_leftovers(self, names: Sequence[str]) -> None:
        """Remove leftovers (only the writer, which holds the lock, calls this)."""

    @abstractmethod
    def lock(self) -> Lock:
        """Take the one-writer lock (LockedError if another writer holds it)."""

    def stored_bytes(self, step: int) -> int:
        """Bytes a (possibly damaged) step takes in the store, as far as it can tell (0 if unknown)."""
        return 0

    def background(self) -> Store:
        """A store on the same location for background copying (the mirror), whose own I/O
        threads, if it has any, are started by the calling thread; the caller closes it unless it
        is this store. Backends without I/O threads of their own return this store."""
        return self

    def check_current(self, doing: str) -> None:
        """Raise StorageError if the store's location was deleted or replaced under its writer."""
        return None  # nothing to do, unless a subclass says otherwise

    def close(self) -> None:
        """Release what the store holds."""
        return None  # nothing to do, unless a subclass says otherwise
