"""``Loop``: the shelf's lean commit path for iterative algorithms.

An iterative algorithm changes the same variables, with the same shapes, every iteration. A loop
fixes them once (:meth:`Shelf.loop <crashsafe.shelf.Shelf.loop>`): each array gets a second block,
its *spare*, and each commit writes one binary record (per array: which of its two blocks is
current, its checksum and version; per scalar: its value and version) into the older of two record
slots, instead of the whole JSON metadata. An iteration computes its arrays straight into the
spares, which no committed state points at, so a crash anywhere in it leaves the previous iteration
intact; the record write is the commit point. Opening a shelf applies the newest valid record to
the metadata (:func:`~crashsafe.shelf.loop_record.read_committed`).

Protocol of one loop iteration, numbered ``committed + 1``: ``begin`` marks it begun in the
records block (so an interrupted iteration is reported on reopen, as any transaction; and since an
iteration begins only after the one before it committed, a mark proves that commit, so a reopen
that finds its record damaged reports the loss: the mark has a checksum for that) and makes the
spares writable; ``abort`` marks it aborted (same number);
``commit`` checksums the spares it commits, makes them durable, writes the record, makes it
durable.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from sys import getrefcount
from typing import Any, Protocol

import numpy as np

import crashsafe._faults as faults
from crashsafe.shelf.errors import ShelfError
from crashsafe.shelf.layout import LOOP_ABORTED_MAGIC, LOOP_BEGUN_MAGIC, LoopLayout
from crashsafe.shelf.loop_record import CHECKSUM, XXH3, LoopRecord, mark, record_fields
from crashsafe.shelf.meta import Entry, Meta

__all__ = ["Loop", "LoopHost"]

_Array = np.ndarray[Any, Any]
_ARMED = faults.SHELF_ARMED
_ABSENT = object()
_SEQ, _TIME = LoopRecord.SEQ, LoopRecord.TIME


def _unreferenced() -> int:
    """``getrefcount`` of a spare only the loop refers to, taken as ``Loop.begin`` takes it (the
    views' tuple, a local, the call's argument): measured, as the count differs across Pythons."""
    views = (np.empty(0), np.empty(0))
    spare = views[1]
    return getrefcount(spare)


_UNREFERENCED = _unreferenced()


class LoopHost(Protocol):
    """The shelf a loop runs on, as the loop sees it (:meth:`Shelf.loop` provides one)."""

    @property
    def buffer(self) -> memoryview:
        """The mapped arena file; the same for the loop's whole life."""

    @property
    def sync_fd(self) -> int | None:
        """The file to ``fdatasync`` at a commit's ordering points; None at ``process`` durability."""

    def block_view(self, entry: Entry) -> _Array:
        """A read-only view of ``entry``'s block, registered as the shelf's views are (it keeps the
        block from being reused while it lives)."""

    @property
    def busy(self) -> str | None:
        """Why no loop iteration may begin now (a transaction is open, or the shelf is unusable),
        or None. Read at every ``begin``: the shelf keeps it current rather than computing it."""

    def end_loop(self, loop: Loop) -> None:
        """``loop.end()``: commit the metadata without the loop and free its blocks."""


class Loop:
    """Commits of an iterative algorithm's state, one lean transaction per iteration.

    Get one from :meth:`Shelf.loop`. Each iteration: ``out = loop.begin()`` hands out a writable
    spare block per array (``out[name]``, shaped like the variable; its contents are undefined:
    write all of it), the algorithm computes into them, and ``loop.commit(values)`` commits
    ``values`` (arrays: the ones handed out, or any array of the same shape and dtype, which is
    copied in; scalars: values of the same type) all at once; the variables missing from
    ``values`` keep their values. ``loop.abort()`` drops the iteration. ``with loop.step() as
    out:`` does all three, starting from a copy of the committed state (see :meth:`step`).

    Double buffering: a committed array's block is the spare two iterations later, so an array
    from ``loop.state`` or ``begin()`` is overwritten by the iteration after next. ``begin``
    refuses to hand out a spare something still refers to; copy what you keep.
    """

    def __init__(self, host: LoopHost, layout: LoopLayout, meta: Meta) -> None:
        self._host = host
        self.layout = layout
        self.names = layout.names
        self._buffer = host.buffer
        self._fd = host.sync_fd
        # where each variable's fields are in a record, as plain tuples (unpacked fastest)
        fields = record_fields(layout)
        self._arrays = [(f.name, f.bit, f.block, f.digest, f.version) for f in fields.arrays]
        self._scalars = [(f.name, f.kind, f.bit, f.value, f.version) for f in fields.scalars]
        self._mask = fields.mask
        self._packing = layout.record
        self._slots = (layout.slot(0), layout.slot(1))
        self._views = [(host.block_view(meta.vars[name]._replace(offset=b0)),
                        host.block_view(meta.vars[name]._replace(offset=b1)))
                       for name, b0, b1 in layout.arrays]
        self._out: dict[str, _Array] | None = None
        self.ended: str | None = None
        self.load(meta)

    def load(self, meta: Meta) -> None:
        """Take the loop's state from ``meta`` (after a commit that did not go through the loop)."""
        # the fields of the last commit's record, as a plain list: the fastest to copy and index
        record = self._last = LoopRecord.of(self.layout, meta)[:]
        self.arrays = {name: views[record[block]]
                       for (name, _, block, _, _), views in zip(self._arrays, self._views, strict=True)}
        self.dirty = False  # committed records not yet applied to the shelf's metadata

    @property
    def seq(self) -> int:
        """The number of the last committed transaction (of the loop or not)."""
        return int(self._last[_SEQ])

    def committed(self) -> LoopRecord:
        """The loop's last commit."""
        return LoopRecord(self._last)

    @property
    def state(self) -> dict[str, Any]:
        """The committed values: arrays as read-only arena views, scalars as Python values."""
        return {**self.arrays, **self._scalar_values()}

    def state_scalars(self) -> list[Any]:
        """The committed values of the scalars, in the loop's order."""
        return [self._last[at] for _, _, _, at, _ in self._scalars]

    def _scalar_values(self) -> dict[str, Any]:
        return {name: self._last[at] for name, _, _, at, _ in self._scalars}

    @property
    def in_iteration(self) -> bool:
        return self._out is not None

    @property
    def writable(self) -> tuple[str, ...]:
        """The arrays with a writable block now: their spares, during an iteration; none otherwise."""
        return tuple(name for (name, *_), views in zip(self._arrays, self._views, strict=True)
                     if any(view.flags.writeable for view in views))

    # ------------------------------------------------------------------ one iteration

    def begin(self) -> dict[str, _Array]:
        """Begin iteration ``seq + 1``: the spare block of each array, writable, by name."""
        if self._out is not None or self.ended is not None:
            self._refuse()
        busy = self._host.busy
        if busy is not None:
            raise ShelfError(busy)
        record = self._last
        out = {}
        for (name, _, block, _, _), views in zip(self._arrays, self._views, strict=True):
            spare = views[1 - record[block]]
            if getrefcount(spare) > _UNREFERENCED:
                raise ShelfError(
                    f"loop.begin(): the array {name!r} committed two iterations ago is still referenced "
                    "(an array, a view of it or a tensor sharing it), and this iteration would overwrite "
                    "it: the loop keeps two blocks per array. Copy what you keep (np.array(a)), or drop it."
                )
            out[name] = spare
        for spare in out.values():  # (only once none is refused)
            spare.setflags(write=True)
        self._mark(LOOP_BEGUN_MAGIC, record[_SEQ] + 1)
        if _ARMED:
            faults.reached("shelf_loop_after_begin")
        self._out = out
        return out

    def commit(self, values: Mapping[str, Any]) -> None:
        """Commit ``values`` (see the class docstring) as iteration ``seq + 1``."""
        out = self._out
        if out is None:
            raise ShelfError("loop.commit() without an iteration: call loop.begin() first")
        record = self._last[:]  # the next record's fields, made from the last's
        seq = record[_SEQ] = record[_SEQ] + 1
        record[_TIME] = time.time()
        mask = used = 0
        for name, bit, block, digest, version in self._arrays:
            value = values.get(name, _ABSENT)
            if value is not _ABSENT:
                used += 1
                spare = out[name]
                if value is not spare:
                    _fill(name, spare, value)
                new_digest = XXH3(spare)
                record[block] ^= 1
                if new_digest != record[digest]:
                    record[digest] = new_digest
                    record[version] += 1
                    mask |= bit
        for name, kind, bit, at, version in self._scalars:
            value = values.get(name, _ABSENT)
            if value is not _ABSENT:
                used += 1
                if type(value) is not kind:
                    value = _scalar(name, kind, value)
                old = record[at]
                if not (value == old or (value != value and old != old)):
                    record[at] = value
                    record[version] += 1
                    mask |= bit
        if used != len(values):
            unknown = sorted(set(values) - set(self.names))
            raise ShelfError(f"loop.commit(): {unknown} are not variables of this loop ({list(self.names)}); "
                             "change them in a transaction of their own")
        record[self._mask] = mask
        try:
            packed = self._packing.pack(*record)
        except struct.error as exc:
            raise ShelfError(f"loop.commit(): a scalar does not fit its record ({exc}); ints must fit "
                             "in 64 bits. Nothing was committed: abort() the iteration") from None
        # the commit: the spares are durable before the record that names them, which is then made durable
        fd, mv, slot = self._fd, self._buffer, self._slots[seq & 1]
        if fd is not None:
            os.fdatasync(fd)
        if _ARMED:
            faults.reached("shelf_loop_before_record")
            faults.write_in_halves(mv, slot, packed, "shelf_loop_mid_record")
        else:
            mv[slot : slot + len(packed)] = packed
        CHECKSUM.pack_into(mv, slot + len(packed), XXH3(packed))
        if fd is not None:
            os.fdatasync(fd)
        if _ARMED:
            faults.reached("shelf_loop_after_record")
        arrays = self.arrays
        for name, spare in out.items():
            spare.setflags(write=False)
            if name in values:
                arrays[name] = spare
        self._last = record
        self.dirty = True
        self._out = None

    def abort(self) -> None:
        """Drop the iteration in progress: nothing it wrote is committed."""
        out, self._out = self._out, None
        if out is None:
            return
        for view in out.values():
            view.setflags(write=False)
        # not an interrupted iteration: a reopen has nothing to report, but its number still proves
        # that the iteration before it committed (should that record be damaged: loop_record.lost)
        self._mark(LOOP_ABORTED_MAGIC, self._last[_SEQ] + 1)

    def _mark(self, magic: bytes, seq: int) -> None:
        line = mark(self.layout, magic, seq, time.time())
        at = self.layout.records
        self._buffer[at : at + len(line)] = line

    @contextmanager
    def step(self) -> Iterator[dict[str, Any]]:
        """``with loop.step() as out:`` begin, with each array's committed value copied into its
        spare (so ``out`` can be changed in part, or in place: ``out["x"] += 1``), and scalars set in
        ``out``; everything in ``out`` is committed on normal exit, nothing on an exception. (The
        copy costs one pass over the arrays; ``begin``/``commit`` skip it.)"""
        out: dict[str, Any] = dict(self.begin())
        for name, spare in tuple(out.items()):
            np.copyto(spare, self.arrays[name])
        out.update(self._scalar_values())
        try:
            yield out
            self.commit(out)
        except BaseException:
            self.abort()
            raise

    def end(self) -> None:
        """Stop the loop: one ordinary commit frees its spare blocks and records."""
        self._host.end_loop(self)

    def detach(self, reason: str) -> None:
        """The shelf dropped or replaced this loop's layout, or closed: drop the iteration in
        progress and the views; the loop refuses any further use, giving ``reason``."""
        self.abort()
        self.ended = reason
        self._views = []
        self.arrays = {}

    def _refuse(self) -> None:
        if self.ended is not None:
            raise ShelfError(f"this loop has ended ({self.ended}); start another with shelf.loop(...)")
        raise ShelfError(f"loop iteration {self.seq + 1} is already begun: commit() or abort() it first")

    def __repr__(self) -> str:
        state = f"ended: {self.ended}" if self.ended else f"seq {self.seq}"
        return f"Loop({list(self.names)}, {state})"


def _fill(name: str, spare: _Array, value: Any) -> None:
    """Copy an array that is not the spare handed out into it (same shape and dtype only)."""
    if not isinstance(value, np.ndarray) or value.shape != spare.shape or value.dtype != spare.dtype:
        got = f"{value.dtype}{list(value.shape)}" if isinstance(value, np.ndarray) else type(value).__name__
        raise ShelfError(
            f"loop.commit(): {name!r} is a {spare.dtype}{list(spare.shape)} array in this loop, got {got}. "
            "A loop keeps its arrays' shapes and dtypes: end it (loop.end()) to change them"
        )
    np.copyto(spare, value, casting="no")


def _scalar(name: str, kind: type, value: Any) -> Any:
    """``value`` as the loop's type for scalar ``name``: a numpy scalar or a subclass of the type is
    converted, an int given for a float too; anything else is refused."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, kind) and (kind is not int or not isinstance(value, bool)):
        return kind(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    raise ShelfError(
        f"loop.commit(): scalar {name!r} is a {kind.__name__} in this loop, got {type(value).__name__} "
        f"({value!r}). A loop keeps each scalar's type: end it (loop.end()) to change it"
    )
