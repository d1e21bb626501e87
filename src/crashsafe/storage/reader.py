"""Read a committed step of any store: validate its manifest, then read and checksum payloads
(whole, or a range of the chunks of a payload with chunk checksums, each chunk verified alone).

This layer verifies bytes; it never decodes them (design rule 14). The store underneath only moves bytes
(:mod:`crashsafe.storage.base`); everything a store could get wrong (a short file, a forged or
damaged manifest, a payload that does not match its checksum) is caught here, for every backend.
"""

from __future__ import annotations

import time
from typing import Any, NoReturn

import numpy as np
import xxhash

from crashsafe._closing import Closing
from crashsafe._memory import alloc_bytes
from crashsafe.errors import CorruptCheckpointError, NoCheckpointError
from crashsafe.format.chunks import chunk_count
from crashsafe.format.manifest import MAX_MANIFEST_BYTES, Manifest, PayloadEntry, loads
from crashsafe.storage.base import Store, StoredFile, StoredStep
from crashsafe.storage.mapped import MappedFile, map_file

__all__ = ["PayloadStream", "StepReader", "check_bytes", "read_manifest"]

_CHECK_CHUNK = 8 << 20
_READ_CHUNK = 2 << 20  # read into place, then checksummed while it is still in the CPU cache
_DISK_CHUNK = 16 << 20  # from the disk: large preadv calls, each checksummed after it lands
# mapping cached pages runs at >100 GB/s here, reading from the (virtual) disk at <5 GB/s
_CACHED_BYTES_PER_SECOND = 16e9


def _manifest_of(stored: StoredStep) -> Manifest:
    manifest = loads(stored.manifest_bytes(MAX_MANIFEST_BYTES + 1), f"{stored.where}: manifest.json")
    if manifest.step != stored.step:
        raise CorruptCheckpointError(f"{stored.where}: manifest says step {manifest.step}")
    return manifest


def _vanished(stored: StoredStep) -> NoCheckpointError:
    return NoCheckpointError(
        f"step {stored.step} was deleted (by retention?) while it was read; read another step"
    )


def read_manifest(store: Store, step: int) -> Manifest:
    """The validated manifest of a committed step."""
    with store.open_step(step) as stored:
        try:
            return _manifest_of(stored)
        except CorruptCheckpointError:
            if stored.vanished():  # deleted while read: its files go one by one
                raise _vanished(stored) from None
            raise


def check_bytes(where: str, entry: PayloadEntry, data: memoryview) -> None:
    """Raise CorruptCheckpointError unless ``data`` are ``entry``'s stored bytes, intact (bytes that
    came from elsewhere, such as a peer's copy of a step, checked before they are written)."""
    view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    if len(view) != entry.nbytes:
        raise CorruptCheckpointError(
            f"{where}: payload '{entry.path}' is {len(view)} bytes, not {entry.nbytes}"
        )
    digest = _Verifier(where, entry, 0, entry.nbytes)
    digest.update(view)
    digest.finish()


class StepReader(Closing):
    """Verified access to one committed step's stored payload bytes (a context manager)."""

    def __init__(self, store: Store, step: int) -> None:
        self.step = step
        self._maps: dict[str, MappedFile | None] = {}  # unmapped when no view of them is left
        self._stored = store.open_step(step)
        self.where = self._stored.where
        self._files: dict[str, StoredFile] = {}
        try:
            self.manifest = _manifest_of(self._stored)
            for name, size in self.manifest.files.items():
                self._files[name] = file = self._stored.open_file(name)
                if file.size != size:
                    raise CorruptCheckpointError(
                        f"{self.where}: {name} is {file.size} bytes but the manifest says {size} "
                        f"({'truncated' if file.size < size else 'extended'})"
                    )
        except CorruptCheckpointError:
            vanished = self._stored.vanished()
            self.close()
            if vanished:
                raise _vanished(self._stored) from None
            raise
        except BaseException:
            self.close()
            raise

    def raise_if_vanished(self) -> None:
        """Raise NoCheckpointError if the step read here was deleted meanwhile (by retention):
        then errors about its files are not damage."""
        if self._stored.vanished():
            raise _vanished(self._stored)

    def read_stored(self, entry: PayloadEntry, chunks: tuple[int, int] | None = None) -> np.ndarray[Any, Any]:
        """The stored (encoded) bytes of a payload, checksum-verified: a read-only view of the
        mapped file where the store maps its files, else a buffer of their own. ``chunks``: only
        the chunks ``[first, end)`` of a payload with chunk checksums, each verified alone."""
        start, stop = self._range(entry, chunks)
        mapped = self._mapped(entry.file)
        if mapped is not None:
            buf = mapped.view(entry.offset + start, stop - start)
        else:
            try:
                buf = alloc_bytes(stop - start)
            except (MemoryError, OSError):  # OSError: mmap's ENOMEM
                raise CorruptCheckpointError(
                    f"{self.where}: payload '{entry.path}' is {entry.nbytes} bytes, more than this machine "
                    "can allocate"
                ) from None
            self._files[entry.file].read_into(buf.data, entry.offset + start)
        digest = _Verifier(self.where, entry, start, stop)
        digest.update(buf.data)
        digest.finish()
        return buf

    def read_into(self, entry: PayloadEntry, out: np.ndarray[Any, Any]) -> None:
        """Read a payload's stored bytes straight into ``out`` (a C-contiguous array of exactly
        ``entry.nbytes`` bytes, e.g. a live tensor's memory), a chunk at a time, each checksummed
        right after it lands, while it is still in the CPU cache (see :class:`PayloadStream`). On
        damage ``out`` holds unverified bytes: the caller decides what that means for the memory
        it passed. (Checksumming chunk i on another thread while chunk i+1 is copied was slower
        here: the hand-offs cost more than a cached checksum.)"""
        dest = out.reshape(-1).view(np.uint8)
        if dest.size != entry.nbytes:
            raise ValueError(f"payload '{entry.path}' is {entry.nbytes} bytes, the buffer {dest.size}")
        stream = self.stream(entry)
        stream.read(dest)
        stream.finish()

    def stream(self, entry: PayloadEntry) -> PayloadStream:
        """A payload's stored bytes, to be read in order into buffers of the caller's choosing (a
        ring of pinned buffers on their way to a GPU), each part checksummed as it lands."""
        return PayloadStream(self, entry)

    def cached(self, entry: PayloadEntry, start: int = 0, stop: int | None = None) -> bool:
        """Whether the first of a payload's bytes ``[start, stop)`` (what a reader reads of it) are
        in the page cache (they map in no time), as a hint of whether the step is: a cached step is
        read fastest by a thread per core, one from the disk by one sequential stream."""
        mapped = self._mapped(entry.file)
        if mapped is None:
            return False
        size = min((entry.nbytes if stop is None else stop) - start, _READ_CHUNK)
        began = time.perf_counter()
        mapped.populate(entry.offset + start, size)
        return time.perf_counter() - began <= size / _CACHED_BYTES_PER_SECOND

    def check_stored(self, entry: PayloadEntry, chunks: tuple[int, int] | None = None) -> None:
        """Verify a payload's checksum (``chunks``: only the chunks ``[first, end)`` of a payload
        with chunk checksums), streaming it over the mapped file while it is cached, else through
        a buffer: verification never holds a whole payload."""
        start, stop = self._range(entry, chunks)
        mapped = self._mapped(entry.file)
        digest = _Verifier(self.where, entry, start, stop)
        while mapped is not None and start < stop:
            size = min(_CHECK_CHUNK, stop - start)
            began = time.perf_counter()
            view = mapped.view(entry.offset + start, size)
            slow = time.perf_counter() - began > size / _CACHED_BYTES_PER_SECOND
            digest.update(view.data)
            start += size
            if slow:
                break
        buf = np.empty(min(stop - start, _CHECK_CHUNK), dtype=np.uint8)
        for begin in range(start, stop, _CHECK_CHUNK):
            size = min(_CHECK_CHUNK, stop - begin)
            self._files[entry.file].read_into(buf.data[:size], entry.offset + begin)
            digest.update(buf.data[:size])
        digest.finish()

    @staticmethod
    def _range(entry: PayloadEntry, chunks: tuple[int, int] | None) -> tuple[int, int]:
        """The payload's bytes ``[start, stop)`` that ``chunks`` cover (None: all of them)."""
        if chunks is None:
            return 0, entry.nbytes
        first, end = chunks
        if entry.chunks is None or not 0 <= first <= end <= chunk_count(entry.nbytes, entry.chunks.size):
            raise ValueError(f"payload '{entry.path}' has no chunks {first}..{end}")
        size = entry.chunks.size
        return first * size, min(end * size, entry.nbytes)

    def _mapped(self, name: str) -> MappedFile | None:
        """Data file ``name`` mapped into memory, if the store's files can be (mapped once)."""
        if name not in self._maps:
            self._maps[name] = map_file(self._files[name], f"{self.where}: {name}", self.manifest.files[name])
        return self._maps[name]

    def close(self) -> None:
        self._maps.clear()
        for file in self._files.values():
            file.close()
        self._files.clear()
        self._stored.close()


class PayloadStream:
    """A payload's stored bytes read in order into the caller's buffers, checksummed as they land.
    From the page cache a chunk is copied out of the mapped file (memcpy speed, faster than
    ``preadv``); once a chunk comes from the disk, the rest is read with large ``preadv`` calls,
    which the disk serves faster than page faults. A store that cannot map reads in one call per
    buffer (a remote store fetches it in ranges of its own choosing). :meth:`finish` raises
    CorruptCheckpointError unless every byte arrived intact."""

    def __init__(self, reader: StepReader, entry: PayloadEntry) -> None:
        self._entry = entry
        self._file = reader._files[entry.file]
        self._mapped = reader._mapped(entry.file)
        self._local = self._mapped is not None  # a mapped file: large reads once it is slow
        self._digest = _Verifier(reader.where, entry, 0, entry.nbytes)
        self._at = 0  # bytes of the payload read so far

    @property
    def local(self) -> bool:
        """Whether the payload's file is mapped (a local file): reads of any size cost no request."""
        return self._local

    def read(self, dest: np.ndarray[Any, Any]) -> None:
        """Fill ``dest`` (a flat uint8 array) with the payload's next ``dest.size`` bytes."""
        if self._at + dest.size > self._entry.nbytes:
            raise ValueError(f"payload '{self._entry.path}' has only {self._entry.nbytes} bytes")
        offset, done = self._entry.offset + self._at, 0
        while self._mapped is not None and done < dest.size:
            chunk = dest[done : done + _READ_CHUNK]
            began = time.perf_counter()
            view = self._mapped.view(offset + done, chunk.size)
            slow = time.perf_counter() - began > chunk.size / _CACHED_BYTES_PER_SECOND
            np.copyto(chunk, view)
            self._digest.update(chunk.data)
            done += chunk.size
            if slow:
                self._mapped = None  # from the disk: the rest by large reads
        step = _DISK_CHUNK if self._local else max(dest.size, 1)
        for begin in range(done, dest.size, step):
            part = dest[begin : begin + step]
            self._file.read_into(part.data, offset + begin)
            self._digest.update(part.data)
        self._at += dest.size

    def finish(self) -> None:
        self._digest.finish()


class _Verifier:
    """Checks a payload's stored bytes ``[start, stop)`` as they arrive, in order: against the
    payload's xxh3 (all of its bytes), or for a payload with chunk checksums (``start`` then lies on
    a chunk's edge) each chunk against its own, as soon as it is whole."""

    def __init__(self, where: str, entry: PayloadEntry, start: int, stop: int) -> None:
        self._where, self._entry = where, entry
        self._at, self._stop = start, stop
        self._digest = xxhash.xxh3_64()
        self._size = entry.nbytes if entry.chunks is None else entry.chunks.size
        self._end = min(start + self._size, stop)  # where the chunk being hashed ends

    def update(self, data: memoryview) -> None:
        """Hash the next bytes; raise CorruptCheckpointError as soon as a chunk of them is damaged."""
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        while len(view):
            take = min(len(view), self._end - self._at)
            if take <= 0:
                raise ValueError(f"payload '{self._entry.path}': more bytes than {self._stop} were checked")
            self._digest.update(view[:take])
            self._at += take
            view = view[take:]
            if self._at == self._end and self._entry.chunks is not None:
                self._close_chunk()

    def finish(self) -> None:
        """Raise CorruptCheckpointError unless every byte arrived and matches its checksum."""
        if self._at != self._stop:
            raise ValueError(f"payload '{self._entry.path}': {self._stop - self._at} bytes were not checked")
        if self._entry.chunks is None and self._digest.hexdigest() != self._entry.xxh3:
            self._damaged(0, self._entry.nbytes)

    def _close_chunk(self) -> None:
        chunks = self._entry.chunks
        assert chunks is not None
        index = (self._end - 1) // self._size
        if self._digest.hexdigest() != chunks.xxh3[index]:
            self._damaged(index * self._size, self._end)
        self._digest.reset()
        self._end = min(self._end + self._size, self._stop)

    def _damaged(self, start: int, stop: int) -> NoReturn:
        entry = self._entry
        raise CorruptCheckpointError(
            f"{self._where}: payload '{entry.path}' fails its checksum ({entry.file} bytes "
            f"{entry.offset + start}..{entry.offset + stop} are damaged)"
        )
