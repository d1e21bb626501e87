"""``CommittedState``: what a shelf has committed, and the metadata writes that change it.

The committed state is the newest metadata slot with the newest commit of the shelf's loop applied
(a loop commits records, not metadata: they are folded in when someone reads the state). A
metadata write goes to the slot that does not hold the newest valid copy and is made durable: it
is the commit point of a transaction, of a rollback (also of one a crash left to roll back when
the shelf opens), of growing the arena, and of starting or ending a loop.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import crashsafe._faults as faults
from crashsafe.shelf.arena import Arena
from crashsafe.shelf.blocks import Blocks
from crashsafe.shelf.errors import CorruptShelfError, ShelfError, ShelfFullError
from crashsafe.shelf.layout import (
    PAGE,
    LoopLayout,
    Record,
    Superblock,
    decode_meta_slot,
    encode_meta_slot,
    new_superblock,
)
from crashsafe.shelf.loop import Loop, LoopHost
from crashsafe.shelf.loop_record import fold, interrupted, loop_variables, lost, read_committed
from crashsafe.shelf.meta import Meta, MetaEncoder, commit_record, encode_meta
from crashsafe.shelf.recovery import RecoveryInfo, restore, scan

__all__ = ["CommittedState", "create"]

_ARMED = faults.SHELF_ARMED


def create(path: Path, size: int) -> None:
    """Create the arena file of a new, empty shelf: its superblock and its first metadata."""
    sb = new_superblock(size)
    if size < sb.data_start + PAGE:
        raise ValueError(f"size {size} is too small for a shelf; use at least {sb.data_start + PAGE}")
    meta = Meta(1, size, tx={"seq": 1, "time": time.time(), "changed": [], "deleted": []})
    slot = encode_meta_slot(1, encode_meta(meta))
    Arena.create(path, size, [(0, sb.pack()), (sb.slot(1), slot)])


class CommittedState:
    """A shelf's committed metadata (:attr:`meta`), its loop object if one runs (:attr:`loop`), and
    the writes that commit new metadata: :meth:`write` (a transaction's), :meth:`roll_back`,
    :meth:`recover`, :meth:`grow`, :meth:`start_loop` and :meth:`end_loop`."""

    def __init__(self, meta: Meta, blocks: Blocks, sb: Superblock, path: Path) -> None:
        self._meta = meta
        self._blocks = blocks
        self.sb = sb
        self.path = path
        self._encoder = MetaEncoder()
        self.loop: Loop | None = None
        self._newest = _newest_slot(blocks.mv, sb)  # the next metadata write goes to the other one

    @classmethod
    def read(cls, arena: Arena, blocks: Blocks, path: Path) -> CommittedState:
        """The state committed in ``arena``, which this maps into ``blocks``; refuses a truncated file."""
        sb = arena.read_superblock()
        blocks.map()
        meta, _ = read_committed(blocks.mv, sb, path)
        if arena.length < meta.size:
            raise CorruptShelfError(f"{path} is shorter ({arena.length} bytes) than its "
                                    f"arena ({meta.size}); the file was truncated. Restore it "
                                    "from a copy.")
        return cls(meta, blocks, sb, path)

    def recover(self) -> RecoveryInfo | None:
        """Roll back the transaction or loop iteration a crash left incomplete, if there is one."""
        mv, meta = self._blocks.mv, self.meta
        incomplete = scan(mv, self.sb, meta.seq) or interrupted(mv, meta)
        if incomplete is None:
            gone = lost(mv, meta)  # committed iterations whose records were damaged since
            if gone is None:
                return None
            first, last, when = gone
            self.roll_back(last, (), f"loop iterations {first}..{last} lost: their records are damaged")
            return RecoveryInfo(last, when, (), lost=last - first + 1)
        restored = self.roll_back(incomplete.seq, incomplete.undo, "crash")
        return RecoveryInfo(incomplete.seq, incomplete.started, tuple(restored))

    def grow(self, size: int) -> None:
        """Grow the arena to ``size`` bytes (before any block is allocated) and commit the size."""
        self._blocks.grow(size)
        grown = replace(self.meta, seq=self.meta.seq + 1, size=size)
        self.write(grown)
        self.meta = grown

    def blocks_in_use(self) -> list[tuple[int, int]]:
        """``(offset, nbytes)`` of every block the committed state uses: variables' and the loop's."""
        meta = self.meta
        used = [(entry.offset, entry.nbytes) for entry in meta.vars.values() if entry.has_block]
        if meta.loop is not None:
            used += meta.loop.blocks(meta.vars)
        return used

    @property
    def meta(self) -> Meta:
        """The committed state, with the loop's commits since the last metadata write applied."""
        loop = self.loop
        if loop is not None and loop.dirty:
            self._meta = fold(self._meta, loop.committed())
            loop.dirty = False
        return self._meta

    @meta.setter
    def meta(self, meta: Meta) -> None:
        self._meta = meta
        if self.loop is not None:
            self.loop.load(meta)

    def write(self, meta: Meta, commit: bool = False) -> None:
        """Write ``meta`` into the slot that does not hold the newest valid copy, and flush: the
        commit (``commit``: ``meta.tx`` is the :func:`commit_record` of the transaction being
        committed). Not slot ``seq % 2``: loop commits advance ``seq`` without writing metadata, so
        that slot was the newest copy after an odd number of them, and a write torn there by a crash
        lost the loop's start and its iterations, silently."""
        blob = encode_meta_slot(meta.seq, self._encoder.encode(meta, commit))
        if len(blob) > self.sb.slot_size:
            raise ShelfFullError(
                f"the shelf's metadata ({len(blob)} bytes) no longer fits its slot "
                f"({self.sb.slot_size} bytes): too many variables. Delete some, or keep them in a "
                "new shelf created with a larger size (slots grow with the size)."
            )
        start = self.sb.slot(1 - self._newest)
        if _ARMED:
            faults.write_in_halves(self._blocks.mv, start, blob, "shelf_mid_meta")
        else:
            self._blocks.mv[start : start + len(blob)] = blob
        self._blocks.sync()
        self._newest = 1 - self._newest

    def roll_back(self, seq: int, undo: tuple[Record, ...], reason: str) -> list[str]:
        """Roll transaction ``seq`` back: copy the bytes its ``undo`` records saved back, make them
        durable, commit metadata numbered ``seq`` noting the rollback; the names restored."""
        meta = self.meta
        restored = restore(self._blocks.mv, meta, undo, self.path)
        self._blocks.sync()
        note: dict[str, Any] = {"tx": seq, "reason": reason, "time": time.time(), "restored": restored}
        rolled_back = replace(meta, seq=seq, rollback=note)
        try:
            self.write(rolled_back)
        except ShelfFullError:  # the committed metadata fills its slot: the note (for inspect) goes
            rolled_back = replace(meta, seq=seq, rollback=None)
            self.write(rolled_back)
        self.meta = rolled_back
        return restored

    # ------------------------------------------------------------------ the loop's layout

    def start_loop(self, host: LoopHost, names: list[str]) -> Loop:
        """The loop over ``names``: the one running, the one the metadata records (resumed), or a
        new one (its layout committed); another loop running is detached."""
        current = self.loop
        if current is not None and set(current.names) == set(names):
            return current
        if current is not None and current.in_iteration:
            raise ShelfError("a loop iteration is in progress: commit() or abort() it before starting "
                             "another loop")
        layout = self.meta.loop
        if layout is None or set(layout.names) != set(names):
            layout = self._new_loop(names)
        if current is not None:
            current.detach(f"replaced by a loop over {names}")
        self.loop = Loop(host, layout, self.meta)
        return self.loop

    def _new_loop(self, names: list[str]) -> LoopLayout:
        """Lay out a loop over ``names`` and commit it (replacing the shelf's previous loop)."""
        meta = self.meta
        arrays, scalars = loop_variables(meta.vars, names)
        seq = meta.seq + 1
        blocks = self._blocks
        taken: list[int] = []
        try:
            spares = []
            for name, entry in arrays:
                taken.append(blocks.alloc(entry.nbytes, name, "the loop's spare of "))
                spares.append((name, entry.offset, taken[-1]))
            layout = LoopLayout(seq, tuple(spares), tuple(scalars), 0)
            taken.append(blocks.alloc(layout.records_bytes, "loop records", "the "))
            layout = replace(layout, records=taken[-1])
            info = commit_record(seq, time.time(), [], [])
            committed = Meta(seq, meta.size, meta.vars, info, meta.rollback, layout)
            self.write(committed, commit=True)
        except BaseException:
            for offset in taken:
                blocks.release(offset)
            raise
        if meta.loop is not None:
            self.drop_loop(meta, f"replaced by a loop over {names}")
        self.meta = committed
        return layout

    def end_loop(self) -> None:
        """Commit the metadata without the loop, and free its spares and records."""
        meta = self.meta
        seq = meta.seq + 1
        committed = replace(meta, seq=seq, tx=commit_record(seq, time.time(), [], []), loop=None)
        self.write(committed, commit=True)
        self.drop_loop(meta, "loop.end() was called")
        self.meta = committed

    def drop_loop(self, before: Meta, reason: str) -> None:
        """After metadata without ``before``'s loop was committed: detach the loop object and free
        the loop's own blocks (its spares in ``before`` and its records)."""
        if self.loop is not None:
            self.loop.detach(reason)
            self.loop = None
        assert before.loop is not None
        for offset, _ in before.loop.blocks(before.vars):
            self._blocks.release(offset)


def _newest_slot(buf: memoryview, sb: Superblock) -> int:
    """The index (0 or 1) of the metadata slot holding the newest valid copy (read_newest's)."""

    def seq(index: int) -> int:
        found = decode_meta_slot(buf[sb.slot(index) : sb.slot(index) + sb.slot_size], sb.slot_size)
        return -1 if found is None else found[0]

    return max((0, 1), key=seq)
