"""Which tensors are provably unchanged since the newest committed step: a save refers to the bytes
that step holds instead of copying and writing them again (docs/design.md, rule 16;
docs/unchanged.md).

The proof is a hash of the tensor's bytes taken at the save point, equal to the hash of the bytes
committed for its path (same dtype and shape): on the CPU the xxh3-64 a raw payload's checksum
already is, on the training thread; on a GPU a fingerprint (:mod:`crashsafe.state.fingerprint`)
computed on the copy stream, ordered exactly as a copy would be (rule 15), that the writer checks
before it refers to anything. Nothing else is trusted: torch's version counter misses writes through
``.data``, numpy or DLPack views, raw pointers and other processes, so it only picks the tensors
worth hashing (a tensor whose counter moved, or that is not the same tensor in the same memory, is
copied without hashing).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from crashsafe._runtime import pool
from crashsafe.codecs.registry import get_codec
from crashsafe.errors import SaveFailedError
from crashsafe.format.chunks import hash_chunks
from crashsafe.format.manifest import Manifest, PayloadEntry, base_mark
from crashsafe.state.fingerprint import DevicePrint, changed, differs, print_of, printable

__all__ = ["MIN_BYTES", "ChangeWatch", "Holding", "Unchanged", "raw_digest"]

MIN_BYTES = 1 << 17  # smaller tensors are copied: hashing them saves too little to be worth a call
HASHING_THREADS = max(1, min(4, os.cpu_count() or 1))
MAX_BACKOFF = 6  # a CPU tensor found changed k times in a row is next hashed 2**(k-1) - 1 saves later (<= 63)
Digest = tuple[int | None, str]  # the chunk size it was taken with (None: xxh3-64 of it all), its hex


@dataclass(frozen=True)
class Holding:
    """Where a path's committed bytes are: the step that owns them, that save's creation time (its
    base mark) and its own entry for them."""

    step: int
    created: float
    entry: PayloadEntry

    def reference(self) -> PayloadEntry:
        """The entry a new step refers to these bytes with."""
        return dataclasses.replace(self.entry, ref=self.step)


@dataclass
class _Seen:
    """A tensor as a save point found it: where it lives and its version, and what proves its bytes
    (xxh3-64 on the CPU, a fingerprint on a device; None: not hashed then)."""

    key: tuple[Any, ...]
    version: int
    digest: Digest | None = None
    print: DevicePrint | None = None
    buffer: np.ndarray[Any, Any] | None = None  # the staging buffer its bytes were copied into
    steady: bool = False  # a device tensor: its print was the same at the save point before this one
    steadiness: Callable[[], bool] | None = None  # that comparison, queued on the device, read at commit
    misses: int = 0  # a CPU tensor: save points in a row it was hashed and found changed
    skip: int = 0  # save points to come at which it is copied without hashing (after misses)


@dataclass
class _Record:
    seen: _Seen
    holding: Holding


@dataclass(frozen=True)
class Unchanged:
    """What a snapshot holds in place of an unchanged tensor's bytes: the committed bytes it equals,
    those bytes themselves where at hand (a staging buffer that holds them, or the live tensor in a
    save that writes before it returns), and, for a device tensor, the check the writer must pass
    (its fingerprint compared on the device) before it refers to them."""

    path: str
    holding: Holding
    array: np.ndarray[Any, Any]
    confirm: Callable[[], bool] | None = None

    def reference(self, committed: frozenset[int], rank: int | None) -> PayloadEntry | None:
        """The entry referring to the committed bytes, or None where they cannot be referred to (their
        step is gone, or another rank wrote them): then ``array``, the same bytes, is written. Raises
        SaveFailedError if a device tensor turned out changed behind torch's back."""
        if self.confirm is not None and not self.confirm():
            raise SaveFailedError(
                f"tensor '{self.path}' changed although torch's version counter did not move (a write "
                "through .data, a numpy or DLPack view, a fused optimizer, or another process): this save "
                "was not committed, so as not to record stale bytes; the next save copies every tensor"
            )
        if self.holding.step in committed and self.holding.entry.rank == rank:
            return self.holding.reference()
        return None


class ChangeWatch:
    """Remembers, per path, the tensor the newest committed step holds and the proof of its bytes;
    decides at each save point which tensors are unchanged. One per writer; it learns a step only
    once the step is committed (:meth:`committed`), and forgets everything after a failed save
    (:meth:`forget`), whose copies may have overwritten committed bytes in staging."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._records: dict[str, _Record] = {}
        self._now: dict[str, _Seen] = {}  # this save point: what each watched tensor was
        self._dropped: dict[str, _Seen] = {}  # this save point: the records it found changed
        self._hashed: dict[str, Digest] = {}  # digests taken by prehash() for the checks that follow
        self._looked: dict[str, tuple[Any, _Seen | None]] = {}  # this save point: each path's tensor

    def begin(self) -> None:
        """A new save point (a snapshot given up before it committed leaves nothing behind)."""
        self._now, self._dropped = {}, {}
        self._hashed, self._looked = {}, {}

    def _look(self, path: str, tensor: Any) -> _Seen | None:
        """``tensor`` at ``path`` as this save point found it, looked at once (prehash, check and saw
        ask in turn: the training thread pays for one look per tensor)."""
        found = self._looked.get(path)
        if found is None or found[0] is not tensor:
            found = self._looked[path] = (tensor, _seen(tensor) if self.enabled else None)
        return found[1]

    def prehash(self, items: list[tuple[str, Any]]) -> None:
        """Hash at once, on every core, the CPU tensors among ``(path, tensor)`` items that
        :meth:`check` would hash: the caller checks each of them right after, at the same save point
        (one thread hashes at about the memory's read speed; two read faster)."""
        jobs = []
        for path, tensor in items:
            record = self._records.get(path)
            if record is None or record.seen.digest is None or record.seen.skip:
                continue
            if tensor.device.type != "cpu":
                continue
            seen = self._look(path, tensor)
            if seen is not None and (seen.key, seen.version) == (record.seen.key, record.seen.version):
                jobs.append((path, tensor, record.seen.digest[0]))
        if len(jobs) > 1:
            hashing = pool("unchanged", HASHING_THREADS)
            digests = hashing.map(lambda job: _digest(_bytes(job[1]), job[2]), jobs)
            self._hashed = {path: digest for (path, _, _), digest in zip(jobs, digests, strict=True)}

    def check(
        self, path: str, tensor: Any, *, held: np.ndarray[Any, Any] | None, live: bool, device: Any = None
    ) -> Unchanged | None:
        """``tensor`` at ``path`` if provably unchanged, else None (the caller copies it, then calls
        :meth:`saw`). ``held``: what the writer writes where the committed bytes cannot be referred
        to (their step is gone), in the leaf's storage type and shape: the staging buffer of ``path``
        (it must be the one that received them), or with ``live`` (a save that writes before it
        returns) the live tensor viewed (``view_bytes``); ``device``: the snapshot's
        :class:`~crashsafe._cuda.DeviceCopies` for a device tensor (None: a CPU tensor).

        None also forgets the record of ``path`` at once: the copy that follows overwrites the buffer
        that held its committed bytes, and a save that fails before it commits (refused in the save
        call, or in planning) must not leave a record whose buffer holds other bytes."""
        found = self._check(path, tensor, held, live, device)
        if found is None and (dropped := self._records.pop(path, None)) is not None:
            self._dropped[path] = dropped.seen  # its print still tells whether the tensor is steady
        return found

    def _check(
        self, path: str, tensor: Any, held: np.ndarray[Any, Any] | None, live: bool, device: Any
    ) -> Unchanged | None:
        record = self._records.get(path)
        seen = self._look(path, tensor)
        if seen is None or record is None:
            return None
        if (seen.key, seen.version) != (record.seen.key, record.seen.version):
            return None
        if held is None or (not live and held is not record.seen.buffer):
            return None  # its buffer is not the one that received the committed bytes: copy it
        if device is not None:
            return self._on_device(path, tensor, record, held, device)
        if record.seen.skip:  # changed at every step behind the counter's back (a fused optimizer)
            seen.misses, seen.skip = record.seen.misses, record.seen.skip - 1
            self._now[path] = seen
            return None
        kept = record.seen.digest
        hashed = self._hashed.pop(path, None)
        if hashed is None:
            hashed = _digest(_bytes(tensor), None if kept is None else kept[0])
        seen.digest = hashed
        self._now[path] = seen
        if kept is None:  # the committed bytes' digest is not known (not stored raw): this one will be
            return None
        if seen.digest != kept:  # found changed twice in a row: hashed again after 1, 3, 7, ... 63 saves
            seen.misses = record.seen.misses + 1
            seen.skip = (1 << min(seen.misses - 1, MAX_BACKOFF)) - 1
            return None
        seen.buffer = record.seen.buffer
        return Unchanged(path, record.holding, held)

    def _on_device(
        self, path: str, tensor: Any, record: _Record, held: np.ndarray[Any, Any], copies: Any
    ) -> Unchanged | None:
        """Queue the fingerprint comparison of a device tensor on its copy stream; the writer waits
        for its verdict (:meth:`Unchanged.reference`). Only for a tensor found steady over the last
        interval: fused optimizers write parameters and their state without moving the version
        counter, and a tensor that changes at every step would fail every save it is not copied in."""
        before = record.seen.print
        if before is None or not record.seen.steady:
            return None
        import torch

        verdict = torch.ones(1, dtype=torch.bool, pin_memory=tensor.is_cuda)
        source = tensor.detach()

        def compare() -> None:
            verdict.copy_(differs(source, before), non_blocking=True)

        ticket = copies.run(source.device.index, compare, source)

        def confirm() -> bool:
            copies.ready(ticket)
            return not bool(verdict.item())

        self._now[path] = dataclasses.replace(record.seen)
        return Unchanged(path, record.holding, held, confirm)

    def saw(self, path: str, tensor: Any, *, buffer: np.ndarray[Any, Any] | None, device: Any = None) -> None:
        """``tensor`` at ``path`` was copied at this save point (into ``buffer``, a staging buffer, if
        any); a device tensor's fingerprint is queued on ``device`` (its snapshot's copies) to prove
        it unchanged at a later save."""
        seen = self._look(path, tensor)
        if seen is None:
            return
        earlier = self._now.get(path)
        if earlier is not None:  # hashed (or skipped) at this very save point, before the copy
            seen.digest, seen.misses, seen.skip = earlier.digest, earlier.misses, earlier.skip
        seen.buffer = buffer
        if device is not None and printable(tensor):
            self._fingerprint(path, tensor, seen, device)
        self._now[path] = seen

    def _fingerprint(self, path: str, tensor: Any, seen: _Seen, copies: Any) -> None:
        """Queue the fingerprint of a device tensor copied at this save point on its copy stream, and
        its comparison with the print of the newest committed step, read at commit: equal, the tensor
        is steady, and the next save may prove it unchanged instead of copying it. Only for a tensor
        seen for the first time or whose version counter did not move since: training's parameters
        and optimizer state move it at every step, and fingerprinting them would cost every save a
        pass over the whole state on the device (and keep ~0.8% of it in prints) for nothing."""
        import torch

        record = self._records.get(path)
        prior = self._dropped.get(path) or (record.seen if record is not None else None)
        if prior is not None and (prior.key, prior.version) != (seen.key, seen.version):
            return
        before = prior.print if prior is not None else None
        source = tensor.detach()
        same = torch.zeros(1, dtype=torch.bool, pin_memory=tensor.is_cuda)

        def fingerprint() -> None:
            seen.print = print_of(source)
            if before is not None:
                same.copy_(~changed(seen.print, before), non_blocking=True)

        ticket = copies.run(source.device.index, fingerprint, source)
        if before is not None:

            def steady() -> bool:
                copies.ready(ticket)
                return bool(same.item())

            seen.steadiness = steady

    def staged(self, path: str, buffer: np.ndarray[Any, Any]) -> None:
        """The bytes of ``path`` copied at this save point (a clone on the device) landed in ``buffer``."""
        seen = self._now.get(path)
        if seen is not None:
            seen.buffer = buffer

    def committed(self, manifest: Manifest, rank: int | None) -> None:
        """``manifest`` committed: what this rank's payloads hold is the newest committed state."""
        records: dict[str, _Record] = {}
        for entry in manifest.payloads:
            seen = self._now.get(entry.path)
            if entry.rank != rank or seen is None:
                continue
            if entry.ref is None:
                holding = Holding(manifest.step, manifest.created, entry)
            else:
                created = manifest.info.get(base_mark(entry.ref))
                if isinstance(created, bool) or not isinstance(created, (int, float)):
                    continue
                holding = Holding(entry.ref, created, dataclasses.replace(entry, ref=None))
            if get_codec(holding.entry.codec).lossy:
                continue  # a lossy payload is not the bytes: encoding them anew may come out closer
            if seen.steadiness is not None:
                seen.steady, seen.steadiness = seen.steadiness(), None
            seen.digest = raw_digest(holding.entry) or seen.digest  # the committed bytes' own, if raw
            records[entry.path] = _Record(seen, holding)
        self._records, self._now, self._dropped, self._looked = records, {}, {}, {}

    def forget(self) -> None:
        """Forget every record: the next save copies every tensor."""
        self._records, self._now, self._dropped, self._looked = {}, {}, {}, {}


def raw_digest(entry: PayloadEntry) -> Digest | None:
    """A payload's checksum where it is a digest of its array's bytes (stored raw: the xxh3-64 of
    them all, or of their chunks' digests), else None."""
    if entry.codec == {"id": "raw"} and entry.nbytes == entry.raw_nbytes:
        return (None if entry.chunks is None else entry.chunks.size, entry.xxh3)
    return None


def _digest(data: np.ndarray[Any, Any], chunk: int | None) -> Digest:
    """``data``'s digest as a raw payload's checksum would be taken (``chunk``: chunk by chunk)."""
    if chunk is None:
        return None, xxhash.xxh3_64_hexdigest(data.data)
    return chunk, hash_chunks(data.data, chunk).combined()


def _seen(tensor: Any) -> _Seen | None:
    """Where ``tensor`` lives and its version, if a save may hash it (in host memory, or on a CUDA
    device that fingerprints it: not MPS, XPU and the like, whose bytes the host cannot read in place;
    big enough, plain bits, one contiguous block, a version counter: inference tensors have none),
    else None. Asked of every big tensor at every save point: a dozen cheap attribute reads."""
    if tensor.nbytes < MIN_BYTES or not (tensor.is_cpu or tensor.is_cuda) or not tensor.is_contiguous():
        return None
    if tensor.is_conj() or tensor.is_neg():
        return None
    try:
        version = tensor._version
    except RuntimeError:  # an inference tensor: no counter at all
        return None
    # a filter, not a proof (the hash is): the memory the tensor's elements sit in, and their layout
    return _Seen((tensor.data_ptr(), tensor.dtype, tensor.shape, tensor.stride(), tensor.device), version)


def _bytes(tensor: Any) -> np.ndarray[Any, Any]:
    """A CPU tensor's bytes, viewed (the caller checked it is contiguous and plain)."""
    import torch

    flat: np.ndarray[Any, Any] = tensor.detach().reshape(-1).view(torch.uint8).numpy()
    return flat
