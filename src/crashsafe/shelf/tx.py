"""``Tx``: the work of one open transaction on a shelf, until it commits or rolls back.

It edits a copy of the committed variables table (``work``). A committed block it may overwrite
in place is first copied to a free block and named in an undo record, both made durable
(:meth:`Tx.protect`); new values of other shapes, new variables and shadow replacements go to
fresh blocks nothing committed points at. At commit the shelf seals the work (:meth:`Tx.seal`:
checksums and versions) and writes it as the new metadata; at rollback the undo records name the
bytes to copy back (:meth:`Tx.undo_records`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import numpy as np

import crashsafe._faults as faults
from crashsafe.shelf.blocks import Blocks, ViewRef
from crashsafe.shelf.errors import ShelfError
from crashsafe.shelf.layout import RECORD_BYTES, Record, Superblock, pack_record
from crashsafe.shelf.meta import DTYPE_NAMES, Entry
from crashsafe.shelf.values import native_dtype, same_scalar

__all__ = ["Tx", "TxMode", "shape_of"]

TxMode = Literal["undo", "shadow"]
_ARMED = faults.SHELF_ARMED
_Array = np.ndarray[Any, Any]


def shape_of(shape: int | Iterable[int]) -> tuple[int, ...]:
    """A shape argument (an int or ints) as a tuple."""
    return (shape,) if isinstance(shape, int) else tuple(map(int, shape))


class Tx:
    """The transaction in progress: its number, its scope, its variables table and what it has done.

    ``scope`` is the arrays that may be written in place through views (None: any that is viewed).
    """

    __slots__ = ("began", "blocks", "committed", "freed", "new_blocks", "opened", "reserved", "sb", "scope",
                 "seq", "touched", "tx_mode", "undo", "work")

    def __init__(self, seq: int, scope: frozenset[str] | None, committed: Mapping[str, Entry], blocks: Blocks,
                 sb: Superblock, tx_mode: TxMode) -> None:
        self.seq = seq
        self.scope = scope
        self.committed = committed
        self.work = dict(committed)  # the variables as this transaction leaves them
        self.blocks = blocks
        self.sb = sb
        self.tx_mode = tx_mode
        self.began = False
        self.undo: dict[int, int] = {}  # committed block -> its saved copy
        self.new_blocks: set[int] = set()
        self.freed: list[int] = []
        self.touched: set[str] = set()  # names assigned, deleted or made writable in place
        self.opened: list[ViewRef] = []  # views made writable (read-only again at the end)
        # arrays handed out by reserve(): id -> (array, its block's entry, its strides)
        self.reserved: dict[int, tuple[_Array, Entry, tuple[int, ...]]] = {}

    def cover(self) -> None:
        """Save what the transaction may write in place through views: the arrays of its scope, or
        (no scope) every array of which a view is alive."""
        if self.scope is not None:
            for name in sorted(self.scope):
                entry = self.work.get(name)
                if entry is None or entry.kind != "array":
                    raise ShelfError(f"transaction({name!r}): no array named {name!r} on the shelf; "
                                     "create it first or leave it out of the list")
                self.protect(name, entry)
        else:
            for name, entry in self.work.items():
                if entry.kind == "array" and self.blocks.live_views(entry.offset):
                    self.protect(name, entry)

    def mark_begun(self) -> None:
        """Write the BEGIN record at the first change, so that a crash from here on is reported."""
        if not self.began:
            at = self.sb.record_off
            self.blocks.mv[at : at + RECORD_BYTES] = pack_record(Record.BEGIN, self.seq, when=time.time())
            self.began = True
            if _ARMED:
                faults.reached("shelf_after_begin")

    def protect(self, name: str, entry: Entry) -> None:
        """Make ``entry``'s block safe to overwrite in place: save its committed bytes first."""
        if entry.offset in self.undo or entry.offset in self.new_blocks:
            return
        self.mark_begun()
        index = len(self.undo) + 1
        if index >= self.sb.record_size // RECORD_BYTES:
            raise ShelfError(f"a transaction can change at most {index - 1} committed variables in place; "
                             "split it, or assign new values instead of writing in place")
        blocks = self.blocks
        saved = blocks.alloc(entry.nbytes, name, "the undo copy of ")
        self.undo[entry.offset] = saved
        blocks.u8[saved : saved + entry.nbytes] = blocks.u8[entry.offset : entry.offset + entry.nbytes]
        at = self.sb.record_off + index * RECORD_BYTES
        record = pack_record(Record.UNDO, self.seq, entry.offset, entry.nbytes, saved)
        blocks.mv[at : at + RECORD_BYTES] = record
        blocks.sync()  # the saved copy and its record are durable before the block changes
        if _ARMED:
            faults.reached("shelf_after_undo")
        self.touched.add(name)
        if self.writable(name, entry):
            blocks.open_views(entry.offset, self.opened)

    def writable(self, name: str, entry: Entry) -> bool:
        """May views of ``entry``'s block be written in this transaction?"""
        if entry.offset in self.new_blocks:
            return True
        return entry.offset in self.undo and (self.scope is None or name in self.scope)

    def view(self, name: str, entry: Entry) -> _Array:
        """The view of ``entry``'s block, writable iff this transaction covers it (without a scope,
        viewing an array covers it)."""
        if self.scope is None and entry.offset not in self.new_blocks:
            self.protect(name, entry)
        return self.blocks.view(entry, self.opened if self.writable(name, entry) else None)

    # ------------------------------------------------------------------ changes

    def set(self, name: str, kind: str, data: Any) -> None:
        """Assign ``data`` (of a kind :func:`~crashsafe.shelf.values.coerce` gives) to ``name``."""
        work = self.work
        old = work.get(name)
        if kind == "scalar":
            # a scalar's entry is final here: the committed one if the value is the same (it keeps
            # its version, and its encoded metadata), else a new version
            committed = self.committed.get(name)
            if committed is None:
                work[name] = Entry("scalar", 1, value=data)
            elif committed.kind == "scalar" and same_scalar(committed.value, data):
                work[name] = committed
            else:
                work[name] = Entry("scalar", committed.version + 1, value=data)
            if old is not None and old.kind != "scalar":
                self._drop_block(old)
        elif kind == "array" and self.reserved and self._adopt(name, data, old):
            pass  # the value was computed in a reserved block: it becomes the variable's
        elif old is not None and kind == "array" and self._is_live_block_view(old, data):
            pass  # the value already is the variable's writable block (see empty())
        elif (kind == "array" and old is not None and old.kind == "array" and self.tx_mode == "undo"
              and old.dtype == DTYPE_NAMES[data.dtype] and old.shape == data.shape):
            self.protect(name, old)
            _copy(self.blocks.typed(old), data)
        else:
            self._put_block(name, kind, data, old)
        self.touched.add(name)

    def delete(self, name: str) -> None:
        entry = self.work.pop(name)
        if entry.has_block:
            self._drop_block(entry)
        self.touched.add(name)

    def empty(self, name: str, shape: int | Iterable[int], dtype: Any) -> _Array:
        """A fresh writable block as ``name``'s new value (:meth:`crashsafe.shelf.Shelf.empty`)."""
        new_shape = shape_of(shape)
        dt, dtype_name = native_dtype(dtype)
        self.mark_begun()
        nbytes = math.prod(new_shape) * dt.itemsize
        entry = self._fresh_block(name, "array", dtype_name, new_shape, nbytes, self.work.get(name))
        self.touched.add(name)
        return self.view(name, entry)

    def reserve(self, shape: int | Iterable[int], dtype: Any) -> _Array:
        """A fresh writable block for no variable yet (:meth:`crashsafe.shelf.Shelf.reserve`)."""
        new_shape = shape_of(shape)
        dt, dtype_name = native_dtype(dtype)
        self.mark_begun()
        offset = self.blocks.alloc(math.prod(new_shape) * dt.itemsize, None)
        self.new_blocks.add(offset)
        view = self.blocks.fresh_view(new_shape, dt, offset, self.opened)
        self.reserved[id(view)] = (view, Entry("array", 0, dtype_name, new_shape, offset, view.nbytes),
                                   view.strides)
        return view

    def _adopt(self, name: str, data: _Array, old: Entry | None) -> bool:
        """Make ``data``, if it is an array from :meth:`reserve` (its shape, strides and dtype
        unchanged), ``name``'s value."""
        held = self.reserved.get(id(data))
        if held is None or held[0] is not data:
            return False
        _, entry, strides = held
        if data.shape != entry.shape or data.strides != strides or DTYPE_NAMES.get(data.dtype) != entry.dtype:
            return False
        del self.reserved[id(data)], held
        if old is not None:
            entry = Entry("array", old.version, entry.dtype, entry.shape, entry.offset, entry.nbytes)
        self.work[name] = entry
        if old is not None and old.has_block:
            self._drop_block(old)
        return True

    def drop_reserved(self) -> None:
        """Free the reserved blocks nobody adopted (pinned while their arrays are alive)."""
        offsets = [entry.offset for _, entry, _ in self.reserved.values()]
        self.reserved.clear()
        for offset in offsets:
            self.new_blocks.discard(offset)
            self.blocks.release(offset)

    def _is_live_block_view(self, entry: Entry, data: Any) -> bool:
        """Is ``data`` a view handed out for ``entry``'s block, writable in this transaction?"""
        if entry.kind != "array" or (entry.offset not in self.new_blocks and entry.offset not in self.undo):
            return False
        return self.blocks.is_view(entry.offset, data)

    def _put_block(self, name: str, kind: str, data: Any, old: Entry | None) -> None:
        """Write ``data`` into a fresh block and point ``name`` at it (a shadow copy)."""
        if kind == "array":
            dtype_name = DTYPE_NAMES[data.dtype]
            entry = self._fresh_block(name, kind, dtype_name, tuple(data.shape), int(data.nbytes), old)
            _copy(self.blocks.typed(entry), data)
        else:
            entry = self._fresh_block(name, kind, "", (), len(data), old)
            self.blocks.mv[entry.offset : entry.offset + entry.nbytes] = data

    def _fresh_block(self, name: str, kind: str, dtype: str, shape: tuple[int, ...], nbytes: int,
                     old: Entry | None) -> Entry:
        """Point ``name`` at a newly allocated block (the old one is freed at commit)."""
        offset = self.blocks.alloc(nbytes, name)
        self.new_blocks.add(offset)
        entry = Entry(kind, old.version if old else 0, dtype, shape, offset, nbytes)  # type: ignore[arg-type]
        self.work[name] = entry
        if old is not None and old.has_block:
            self._drop_block(old)
        return entry

    def _drop_block(self, entry: Entry) -> None:
        if entry.offset in self.new_blocks:
            self.blocks.close_views(entry.offset)
            self.new_blocks.discard(entry.offset)
            self.blocks.release(entry.offset)
        else:
            if entry.offset in self.undo:  # (only blocks of this transaction have writable views)
                self.blocks.close_views(entry.offset)
            self.freed.append(entry.offset)

    # ------------------------------------------------------------------ the end

    def seal(self) -> tuple[list[str], list[str]]:
        """Checksum the blocks written, give every entry its committed version, and make the blocks
        durable: the (changed, deleted) names, sorted, of the commit."""
        changed, deleted = [], []
        blocks_written = False
        committed, work = self.committed, self.work
        for name in self.touched:
            old, entry = committed.get(name), work.get(name)
            if entry is None:
                if old is not None:
                    deleted.append(name)
                continue
            if entry.kind != "scalar":  # (a scalar's entry is final when it is set)
                digest = self.blocks.digest(entry.offset, entry.nbytes)
                work[name] = entry = _sealed(old, entry, digest)
                blocks_written = True
            if old is None or entry.version != old.version:
                changed.append(name)
        if blocks_written:
            self.blocks.sync()
        changed.sort()
        deleted.sort()
        return changed, deleted

    def undo_records(self) -> tuple[Record, ...]:
        """The undo records this transaction wrote (to roll it back in this process)."""
        sizes = {e.offset: e.nbytes for e in self.committed.values() if e.has_block}
        return tuple(Record(Record.UNDO, self.seq, target, sizes[target], saved)
                     for target, saved in self.undo.items())

    def committed_leftovers(self) -> list[int]:
        """The blocks to free once the transaction committed: undo copies and replaced blocks."""
        return [*self.undo.values(), *self.freed]

    def rolled_back_leftovers(self) -> list[int]:
        """The blocks to free once the transaction rolled back: undo copies and its new blocks
        (reserved arrays die with them unless held: their blocks are free, not pinned)."""
        self.reserved.clear()
        return [*self.undo.values(), *self.new_blocks]

    def close(self) -> None:
        """Make the views this transaction made writable read-only again."""
        for ref in self.opened:
            view = ref()
            if view is not None:
                view.flags.writeable = False


def _sealed(old: Entry | None, new: Entry, digest: int) -> Entry:
    """The committed entry of block ``new`` with checksum ``digest``: version 1 if the variable is
    new, unchanged if its content is (then ``old`` itself if it is the same block), else old + 1."""
    if old is None:
        return Entry(new.kind, 1, new.dtype, new.shape, new.offset, new.nbytes, digest)
    if (old.digest == digest and old.kind == new.kind and old.nbytes == new.nbytes
            and old.shape == new.shape and old.dtype == new.dtype):
        if old.offset == new.offset:
            return old
        return Entry(new.kind, old.version, new.dtype, new.shape, new.offset, new.nbytes, digest)
    return Entry(new.kind, old.version + 1, new.dtype, new.shape, new.offset, new.nbytes, digest)


def _copy(dst: _Array, src: _Array) -> None:
    if _ARMED and dst.size > 1:
        flat_dst, flat_src = dst.reshape(-1), np.ascontiguousarray(src).reshape(-1)
        half = flat_dst.size // 2
        np.copyto(flat_dst[:half], flat_src[:half], casting="equiv")
        faults.reached("shelf_mid_write")
        np.copyto(flat_dst[half:], flat_src[half:], casting="equiv")
    else:
        np.copyto(dst, src, casting="equiv")
