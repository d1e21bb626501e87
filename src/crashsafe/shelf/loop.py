"""``Loop``: the shelf's lean commit path for iterative algorithms.

An iterative algorithm changes the same variables, with the same shapes, every iteration. A loop
fixes them once (:meth:`Shelf.loop <crashsafe.shelf.Shelf.loop>`): each array gets a second block,
its *spare*, and each commit writes one binary record (per array: which of its two blocks is
current, its checksum and version; per scalar: its value and version) into the older of two record
slots, instead of the whole JSON metadata. An iteration computes its arrays straight into the
spares, which no committed state points at, so a crash anywhere in it leaves the previous iteration
intact; the record write is the commit point. Opening a shelf applies the newest valid record to
the metadata (:func:`read_committed`).

Protocol of one loop iteration, numbered ``committed + 1``: ``begin`` marks it begun in the
records block (so an interrupted iteration is reported on reopen, as any transaction; the mark
only decides that report, so it needs no checksum) and makes the spares writable;
``commit`` checksums the spares it commits, makes them durable, writes the record, makes it
durable.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from sys import getrefcount
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import xxhash

import crashsafe._faults as faults
from crashsafe.shelf.errors import CorruptShelfError, ShelfError
from crashsafe.shelf.layout import LOOP_BEGUN, LOOP_BEGUN_MAGIC, LOOP_MAGIC, LoopLayout, Superblock
from crashsafe.shelf.meta import Entry, Meta, commit_record, read_newest
from crashsafe.shelf.recovery import Incomplete

if TYPE_CHECKING:
    from crashsafe.shelf.shelf import Shelf

__all__ = ["Loop", "LoopState", "fold", "intact", "interrupted", "is_loop_scalar", "read_committed"]

_Array = np.ndarray[Any, Any]
_ARMED = faults.SHELF_ARMED
_U64 = struct.Struct("<Q")
_ABSENT = object()
_TYPES: dict[str, type] = {"bool": bool, "int": int, "float": float}
_XXH3: Callable[[Any], int] = xxhash.xxh3_64_intdigest  # (ndarrays are buffers)


def _unreferenced() -> int:
    """``getrefcount`` of a spare only the loop refers to, taken as ``Loop.begin`` takes it (the
    views' tuple, a local, the call's argument): measured, as the count differs across Pythons."""
    views = (np.empty(0), np.empty(0))
    spare = views[1]
    return getrefcount(spare)


_UNREFERENCED = _unreferenced()


class LoopState(NamedTuple):
    """One loop commit: what its record holds, field by field (``mask``: variables it changed)."""

    seq: int
    time: float
    blocks: tuple[int, ...]
    digests: tuple[int, ...]
    array_versions: tuple[int, ...]
    values: tuple[Any, ...]
    scalar_versions: tuple[int, ...]
    mask: int


def fold(meta: Meta, state: LoopState) -> Meta:
    """``meta`` with loop commit ``state`` applied: the committed state after it."""
    layout = meta.loop
    assert layout is not None
    variables = dict(meta.vars)
    changed = []
    bit = 1
    for (name, *offsets), index, digest, version in zip(layout.arrays, state.blocks, state.digests,
                                                        state.array_versions, strict=True):
        variables[name] = variables[name]._replace(version=version, offset=offsets[index], digest=digest)
        if state.mask & bit:
            changed.append(name)
        bit <<= 1
    for (name, _), value, version in zip(layout.scalars, state.values, state.scalar_versions, strict=True):
        variables[name] = Entry("scalar", version, value=value)
        if state.mask & bit:
            changed.append(name)
        bit <<= 1
    changed.sort()
    return Meta(state.seq, meta.size, variables, commit_record(state.seq, state.time, changed, []),
                meta.rollback, layout)


def _unpack(buf: memoryview, layout: LoopLayout, at: int, path: object) -> LoopState | None:
    """The loop commit in the slot at ``at``, or None if the slot is empty, torn, damaged or not
    this loop's; a record whose checksum matches but whose fields are impossible is refused."""
    record = layout.record
    if at + record.size + _U64.size > len(buf):
        return None
    fields = record.unpack_from(buf, at)
    if fields[0] != LOOP_MAGIC or fields[2] != layout.id:
        return None
    if _U64.unpack_from(buf, at + record.size)[0] != _XXH3(buf[at : at + record.size]):
        return None
    n = len(layout.arrays)
    arrays, scalars = fields[4 : 4 + 3 * n], fields[4 + 3 * n : -1]
    index, versions = arrays[0::3], arrays[2::3]
    values = tuple(_TYPES[kind](value)
                   for (_, kind), value in zip(layout.scalars, scalars[0::2], strict=True))
    if any(i not in (0, 1) for i in index) or min((*versions, *scalars[1::2]), default=1) < 1:
        raise CorruptShelfError(
            f"{path}: a loop record of the shelf names a block or version that cannot exist although "
            "its checksum matches; the file was forged or written by a broken tool. Refusing to use it."
        )
    return LoopState(fields[1], fields[3], index, arrays[1::3], versions, values, scalars[1::2], fields[-1])


def read_committed(buf: memoryview, sb: Superblock, path: object) -> tuple[Meta, str]:
    """The committed state: the newest metadata slot (:func:`read_newest`) with the newest valid
    record of its loop applied, if that is newer."""
    meta, spare = read_newest(buf, sb, path)
    layout = meta.loop
    if layout is not None:
        found = [s for s in (_unpack(buf, layout, layout.slot(n), path) for n in (0, 1))
                 if s is not None and s.seq > meta.seq]
        if found:
            meta = fold(meta, max(found))
    return meta, spare


def interrupted(buf: memoryview, meta: Meta) -> Incomplete | None:
    """The loop iteration a crash interrupted (begun after the committed state ``meta``), if any."""
    if meta.loop is None:
        return None
    magic, seq, when = LOOP_BEGUN.unpack_from(buf, meta.loop.records)
    return Incomplete(seq, when, ()) if magic == LOOP_BEGUN_MAGIC and seq == meta.seq + 1 else None


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

    def __init__(self, shelf: Shelf, layout: LoopLayout) -> None:
        self._shelf = shelf
        self.layout = layout
        self.names = layout.names
        self._fd = shelf._arena.fd if shelf._arena.durability == "power" else None  # fdatasync it?
        self._array_names = tuple(name for name, _, _ in layout.arrays)
        self._scalars = tuple((name, _TYPES[kind]) for name, kind in layout.scalars)
        self._record = layout.record
        self._slots = (layout.slot(0), layout.slot(1))
        meta = shelf._meta
        self._views = [(shelf._block_view(name, meta.vars[name], b0),
                        shelf._block_view(name, meta.vars[name], b1)) for name, b0, b1 in layout.arrays]
        self._out: dict[str, _Array] | None = None
        self.ended: str | None = None
        self.load(meta)

    def load(self, meta: Meta) -> None:
        """Take the loop's state from ``meta`` (after a commit that did not go through the loop)."""
        entries = meta.vars
        # the fields of the last commit's record: magic, seq, id, time, (block, xxh3, version) per
        # array, (value, version) per scalar, mask of the variables it changed
        fields: list[Any] = [LOOP_MAGIC, meta.seq, self.layout.id, float(meta.tx.get("time", 0.0))]
        for name, b0, _ in self.layout.arrays:
            entry = entries[name]
            fields += (0 if entry.offset == b0 else 1, entry.digest, entry.version)
        for name, _ in self.layout.scalars:
            fields += (entries[name].value, entries[name].version)
        fields.append(0)
        self._fields = fields
        self.arrays = {name: views[fields[4 + 3 * i]]
                       for i, (name, views) in enumerate(zip(self._array_names, self._views, strict=True))}
        self.dirty = False  # committed records not yet applied to the shelf's metadata

    @property
    def seq(self) -> int:
        """The number of the last committed transaction (of the loop or not)."""
        return int(self._fields[1])

    def committed(self) -> LoopState:
        """The loop's last commit."""
        f, n = self._fields, 4 + 3 * len(self._array_names)
        return LoopState(f[1], f[3], tuple(f[4:n:3]), tuple(f[5:n:3]), tuple(f[6:n:3]), tuple(f[n:-1:2]),
                         tuple(f[n + 1 : -1 : 2]), f[-1])

    @property
    def state(self) -> dict[str, Any]:
        """The committed values: arrays as read-only arena views, scalars as Python values."""
        return {**self.arrays, **dict(zip(self.names[len(self._array_names) :], self.state_scalars(),
                                          strict=True))}

    def state_scalars(self) -> list[Any]:
        """The committed values of the scalars, in the loop's order."""
        return self._fields[4 + 3 * len(self._array_names) : -1 : 2]

    @property
    def in_iteration(self) -> bool:
        return self._out is not None

    @property
    def writable(self) -> tuple[str, ...]:
        """The arrays with a writable block now: their spares, during an iteration; none otherwise."""
        return tuple(name for name, views in zip(self._array_names, self._views, strict=True)
                     if any(view.flags.writeable for view in views))

    # ------------------------------------------------------------------ one iteration

    def begin(self) -> dict[str, _Array]:
        """Begin iteration ``seq + 1``: the spare block of each array, writable, by name."""
        shelf = self._shelf
        if (self._out is not None or self.ended is not None or shelf._tx is not None or shelf._arena.closed
                or shelf._broken is not None):
            self._refuse()
        fields = self._fields
        out = {}
        at = 4
        for name, views in zip(self._array_names, self._views, strict=True):
            spare = views[1 - fields[at]]
            if getrefcount(spare) > _UNREFERENCED:
                raise ShelfError(
                    f"loop.begin(): the array {name!r} committed two iterations ago is still referenced "
                    "(an array, a view of it or a tensor sharing it), and this iteration would overwrite "
                    "it: the loop keeps two blocks per array. Copy what you keep (np.array(a)), or drop it."
                )
            out[name] = spare
            at += 3
        for spare in out.values():  # (only once none is refused)
            spare.setflags(write=True)
        LOOP_BEGUN.pack_into(shelf._mv, self.layout.records, LOOP_BEGUN_MAGIC, fields[1] + 1, time.time())
        if _ARMED:
            faults.reached("shelf_loop_after_begin")
        self._out = out
        return out

    def commit(self, values: Mapping[str, Any]) -> None:
        """Commit ``values`` (see the class docstring) as iteration ``seq + 1``."""
        out = self._out
        if out is None:
            raise ShelfError("loop.commit() without an iteration: call loop.begin() first")
        fields = self._fields[:]
        seq = fields[1] = fields[1] + 1
        fields[3] = time.time()
        mask, bit, used, at = 0, 1, 0, 4
        for name in self._array_names:
            value = values.get(name, _ABSENT)
            if value is not _ABSENT:
                used += 1
                spare = out[name]
                if value is not spare:
                    _fill(name, spare, value)
                digest = _XXH3(spare)
                fields[at] ^= 1
                if digest != fields[at + 1]:
                    fields[at + 1] = digest
                    fields[at + 2] += 1
                    mask |= bit
            at += 3
            bit <<= 1
        for name, kind in self._scalars:
            value = values.get(name, _ABSENT)
            if value is not _ABSENT:
                used += 1
                if type(value) is not kind:
                    value = _scalar(name, kind, value)
                old = fields[at]
                if not (value == old or (value != value and old != old)):
                    fields[at] = value
                    fields[at + 1] += 1
                    mask |= bit
            at += 2
            bit <<= 1
        if used != len(values):
            unknown = sorted(set(values) - set(self.names))
            raise ShelfError(f"loop.commit(): {unknown} are not variables of this loop ({list(self.names)}); "
                             "change them in a transaction of their own")
        fields[at] = mask
        try:
            packed = self._record.pack(*fields)
        except struct.error as exc:
            raise ShelfError(f"loop.commit(): a scalar does not fit its record ({exc}); ints must fit "
                             "in 64 bits. Nothing was committed: abort() the iteration") from None
        # the commit: the spares are durable before the record that names them, which is then made durable
        fd, mv, slot = self._fd, self._shelf._mv, self._slots[seq & 1]
        if fd is not None:
            os.fdatasync(fd)
        if _ARMED:
            faults.reached("shelf_loop_before_record")
            faults.write_in_halves(mv, slot, packed, "shelf_loop_mid_record")
        else:
            mv[slot : slot + len(packed)] = packed
        _U64.pack_into(mv, slot + len(packed), _XXH3(packed))
        if fd is not None:
            os.fdatasync(fd)
        if _ARMED:
            faults.reached("shelf_loop_after_record")
        arrays = self.arrays
        for name, spare in out.items():
            spare.setflags(write=False)
            if name in values:
                arrays[name] = spare
        self._fields = fields
        self.dirty = True
        self._out = None

    def abort(self) -> None:
        """Drop the iteration in progress: nothing it wrote is committed."""
        out, self._out = self._out, None
        if out is None:
            return
        for view in out.values():
            view.setflags(write=False)
        shelf = self._shelf
        if not shelf._arena.closed:  # not an interrupted iteration: a reopen has nothing to report
            LOOP_BEGUN.pack_into(shelf._mv, self.layout.records, bytes(8), 0, 0.0)

    @contextmanager
    def step(self) -> Iterator[dict[str, Any]]:
        """``with loop.step() as out:`` begin, with each array's committed value copied into its
        spare (so ``out`` can be changed in part, or in place: ``out["x"] += 1``), and scalars set in
        ``out``; everything in ``out`` is committed on normal exit, nothing on an exception. (The
        copy costs one pass over the arrays; ``begin``/``commit`` skip it.)"""
        out: dict[str, Any] = dict(self.begin())
        for name, spare in tuple(out.items()):
            np.copyto(spare, self.arrays[name])
        out.update(zip(self.names[len(self._array_names) :], self.state_scalars(), strict=True))
        try:
            yield out
            self.commit(out)
        except BaseException:
            self.abort()
            raise

    def end(self) -> None:
        """Stop the loop: one ordinary commit frees its spare blocks and records."""
        self._shelf._end_loop(self)

    def _refuse(self) -> None:
        if self.ended is not None:
            raise ShelfError(f"this loop has ended ({self.ended}); start another with shelf.loop(...)")
        if self._out is not None:
            raise ShelfError(f"loop iteration {self.seq + 1} is already begun: commit() or abort() it first")
        if self._shelf._tx is not None:
            raise ShelfError("a transaction is open on this shelf; a loop iteration cannot run inside it")
        self._shelf._check_open()

    def _end(self, reason: str) -> None:
        """This loop object is done (its layout was dropped or replaced): drop its views."""
        self.abort()
        self.ended = reason
        self._views = []
        self.arrays = {}

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


def is_loop_scalar(value: Any) -> bool:
    """Can a loop commit this scalar (a bool, an int that fits 64 bits, or a float)?"""
    kind = type(value)
    return kind is bool or kind is float or (kind is int and -(1 << 63) <= value < 1 << 63)


def intact(layout: LoopLayout, variables: Mapping[str, Entry]) -> bool:
    """Does ``layout`` still describe ``variables`` (each array in one of its blocks, each scalar of
    its type)? A commit that broke it ends the loop."""
    for name, b0, b1 in layout.arrays:
        entry = variables.get(name)
        if entry is None or entry.kind != "array" or entry.offset not in (b0, b1):
            return False
    for name, kind in layout.scalars:
        entry = variables.get(name)
        if entry is None or entry.kind != "scalar" or type(entry.value) is not _TYPES[kind]:
            return False
    return True
