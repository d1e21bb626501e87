"""``Shelf``: named numpy arrays, scalars and strings in a memory-mapped arena file, changed in
all-or-nothing transactions and recovered after a crash (PyMM's model, with the recovery PyMM lacks).

Protocol of one transaction (numbered ``committed + 1``):

1. at its first change a BEGIN record is written;
2. before a committed block is overwritten in place, its bytes are copied to a free block, an undo
   record is written, and both are made durable (undo log);
3. new values of other shapes, new variables, and (``tx_mode="shadow"``) replacements go to fresh
   blocks that the committed metadata does not reference (shadow copies);
4. commit: checksum the changed blocks, make them durable, write the new metadata into the spare of
   two checksummed metadata slots, make it durable. That write is the commit point.

"Durable" is an ``fdatasync`` at ``power`` durability and nothing at ``process`` durability, where
program order already decides what a killed process leaves in the page cache.

After a crash the newest valid slot wins and the undo records of an incomplete transaction copy the
old bytes back; blocks it allocated were never referenced by committed metadata, so they are free.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import numpy as np
import xxhash

import crashsafe._faults as faults
from crashsafe._torch import is_tensor
from crashsafe.errors import UnsupportedStateError
from crashsafe.shelf import loop as loops
from crashsafe.shelf import recovery
from crashsafe.shelf.alloc import Allocator
from crashsafe.shelf.arena import Arena, Durability, parse_size
from crashsafe.shelf.errors import CorruptShelfError, ShelfError, ShelfFullError, ShelfRecoveredWarning
from crashsafe.shelf.layout import (
    LOOP_LIMIT,
    PAGE,
    RECORD_BYTES,
    LoopLayout,
    Record,
    Superblock,
    encode_meta_slot,
    new_superblock,
    pack_record,
)
from crashsafe.shelf.meta import (
    DTYPE_NAMES,
    NUMERIC_DTYPES,
    Entry,
    Meta,
    MetaEncoder,
    commit_record,
    encode_meta,
    scalar_ok,
    scalar_type,
)

__all__ = ["RecoveryInfo", "Shelf", "Transaction", "TxMode", "VarInfo"]

TxMode = Literal["undo", "shadow"]
_ARMED = faults.SHELF_ARMED
_Array = np.ndarray[Any, Any]


@dataclass(frozen=True)
class RecoveryInfo:
    """What opening the shelf rolled back: the transaction number and the variables restored."""

    seq: int
    started: float
    restored: tuple[str, ...]


@dataclass(frozen=True)
class VarInfo:
    """Description of one variable (see :meth:`Shelf.info`)."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    version: int
    offset: int


class _Tx:
    """The transaction in progress: its number, its scope, and what it has done so far."""

    __slots__ = ("began", "freed", "new_blocks", "opened", "reserved", "scope", "seq", "touched", "undo")

    def __init__(self, seq: int, scope: frozenset[str] | None) -> None:
        self.seq = seq
        self.scope = scope
        self.began = False
        self.undo: dict[int, int] = {}  # committed block -> its saved copy
        self.new_blocks: set[int] = set()
        self.freed: list[int] = []
        self.touched: set[str] = set()  # names assigned, deleted or made writable in place
        self.opened: list[weakref.ref[_Array]] = []  # views made writable (read-only again at the end)
        # arrays handed out by reserve(): id -> (array, its block's entry, its strides)
        self.reserved: dict[int, tuple[_Array, Entry, tuple[int, ...]]] = {}


class Transaction:
    """Context manager of one transaction: commits on normal exit, rolls back on an exception."""

    def __init__(self, shelf: Shelf, scope: frozenset[str] | None) -> None:
        self._shelf = shelf
        self._scope = scope
        self._tx: _Tx | None = None

    def __enter__(self) -> Transaction:
        self._tx = self._shelf._begin(self._scope)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._shelf._tx is not self._tx:
            if exc is None:
                raise ShelfError("the shelf was closed inside this transaction, which was rolled back; "
                                 "nothing was committed")
            return
        if exc is None:
            self._shelf._commit()
        else:
            self._shelf._abort(f"{type(exc).__name__}: {exc}")


class Shelf(MutableMapping[str, Any]):
    """A crash-consistent, memory-mapped store of named variables.

    Args:
        path: the arena file; created (with ``size``) if missing, reopened (and recovered) if not.
        size: arena size in bytes or as ``"1GiB"``; required to create. A larger size given on
            reopen grows the arena.
        durability: ``"process"`` (no flushes; survives process crashes), ``"power"`` (fdatasync at
            every ordering point; survives power loss on disk) or ``"auto"`` (process on tmpfs).
        tx_mode: how assigning to an existing array of the same shape and dtype works inside a
            transaction: ``"shadow"`` writes a fresh block and switches to it at commit;
            ``"undo"`` saves the old bytes to the undo log and writes in place (older views then
            show the new value). In-place writes through views always use the undo log.
        verify: check every variable's checksum when opening (cost: hashing the used bytes).

    Values read back are arena-backed ndarrays: read-only outside transactions, writable inside a
    transaction that covers them. ``str``/``bytes`` come back as copies, scalars as Python values.
    """

    _committed: Meta  # (see _meta)

    def __init__(
        self,
        path: str | os.PathLike[str],
        size: int | str | None = None,
        *,
        durability: Durability = "auto",
        tx_mode: TxMode = "shadow",
        verify: bool = True,
    ) -> None:
        if tx_mode not in ("undo", "shadow"):
            raise ValueError(f"tx_mode must be 'undo' or 'shadow', got {tx_mode!r}")
        if durability not in ("auto", "process", "power"):
            raise ValueError(f"durability must be 'auto', 'process' or 'power', got {durability!r}")
        self.path = Path(path)
        self.tx_mode: TxMode = tx_mode
        self.recovered: RecoveryInfo | None = None
        self._tx: _Tx | None = None
        self._work: dict[str, Entry] = {}
        self._broken: str | None = None
        self._views: dict[int, list[weakref.ref[_Array]]] = {}
        self._pinned: set[int] = set()
        self._encoder = MetaEncoder()
        self._loop: loops.Loop | None = None
        wanted = parse_size(size) if size is not None else None
        if not self.path.exists():
            if wanted is None:
                raise ShelfError(f"the shelf {self.path} does not exist; pass size= (e.g. '1GiB') to "
                                 "create it")
            self._create(wanted)
        self._arena = Arena.open(self.path, durability)
        try:
            self._open(wanted, verify)
        except BaseException:
            self._release_buffers()
            self._arena.close()
            raise

    # ------------------------------------------------------------------ opening and recovery

    def _create(self, size: int) -> None:
        sb = new_superblock(size)
        if size < sb.data_start + PAGE:
            raise ValueError(f"size {size} is too small for a shelf; use at least {sb.data_start + PAGE}")
        meta = Meta(1, size, tx={"seq": 1, "time": time.time(), "changed": [], "deleted": []})
        slot = encode_meta_slot(1, encode_meta(meta))
        Arena.create(self.path, size, [(0, sb.pack()), (sb.slot(1), slot)])

    def _open(self, wanted: int | None, verify: bool) -> None:
        self._sb: Superblock = self._arena.read_superblock()
        self._map_buffers()
        self._meta, _ = loops.read_committed(self._mv, self._sb, self.path)
        if self._arena.length < self._meta.size:
            raise CorruptShelfError(f"{self.path} is shorter ({self._arena.length} bytes) than its "
                                    f"arena ({self._meta.size}); the file was truncated. Restore it "
                                    "from a copy.")
        meta = self._meta
        incomplete = recovery.scan(self._mv, self._sb, meta.seq) or loops.interrupted(self._mv, meta)
        if incomplete is not None:
            self._recover(incomplete)
        if verify:
            self.verify()
        if wanted is not None and wanted > self._meta.size:
            self._grow(wanted)
        self._alloc = Allocator(self._sb.data_start, self._meta.size)
        for entry in self._meta.vars.values():
            if entry.has_block:
                self._alloc.mark(entry.offset, entry.nbytes)
        if self._meta.loop is not None:
            for offset, nbytes in self._meta.loop.blocks(self._meta.vars):
                self._alloc.mark(offset, nbytes)

    @property
    def _meta(self) -> Meta:
        """The committed state, with the loop's commits since the last metadata write applied."""
        loop = self._loop
        if loop is not None and loop.dirty:
            self._committed = loops.fold(self._committed, loop.committed())
            loop.dirty = False
        return self._committed

    @_meta.setter
    def _meta(self, meta: Meta) -> None:
        self._committed = meta
        if self._loop is not None:
            self._loop.load(meta)

    def _recover(self, incomplete: recovery.Incomplete) -> None:
        restored = recovery.restore(self._mv, self._meta, incomplete.undo, self.path)
        self._arena.sync()
        note = {"tx": incomplete.seq, "reason": "crash", "time": time.time(), "restored": restored}
        self._meta = replace(self._meta, seq=incomplete.seq, rollback=note)
        self._write_meta(self._meta)
        self.recovered = RecoveryInfo(incomplete.seq, incomplete.started, tuple(restored))
        warnings.warn(
            f"shelf {self.path}: transaction {incomplete.seq} did not commit (a crash interrupted it, "
            f"or its metadata is damaged) and has been rolled back ({len(restored)} variables "
            f"restored in place); the shelf holds the state committed before it.",
            ShelfRecoveredWarning,
            stacklevel=4,
        )

    def _grow(self, size: int) -> None:
        self._release_buffers()
        self._arena.grow(size)
        self._map_buffers()
        self._meta = replace(self._meta, seq=self._meta.seq + 1, size=size)
        self._write_meta(self._meta)

    def verify(self) -> None:
        """Check every variable's bytes against its committed checksum; raise on any mismatch."""
        self._check_open()
        if self._tx is not None:
            raise ShelfError("verify() checks committed data; call it outside a transaction")
        bad = [name for name, e in self._meta.vars.items()
               if e.has_block and self._digest(e.offset, e.nbytes) != e.digest]
        if bad:
            raise CorruptShelfError(
                f"{self.path}: {len(bad)} variable(s) do not match their committed checksums: "
                f"{', '.join(map(repr, bad[:10]))}. Either the file is damaged or they were written "
                "outside a transaction (through a view kept from an earlier transaction). Restore "
                "the file from a copy, or reassign those variables."
            )

    # ------------------------------------------------------------------ mapping interface

    def __getitem__(self, name: str) -> Any:
        self._check_open()
        entry = self._tx_vars()[name]
        if entry.kind == "scalar":
            return entry.value
        if entry.kind == "bytes":
            return bytes(self._mv[entry.offset : entry.offset + entry.nbytes])
        if entry.kind == "str":
            return bytes(self._mv[entry.offset : entry.offset + entry.nbytes]).decode()
        return self._view(name, entry)

    def __setitem__(self, name: str, value: Any) -> None:
        self._check_open()
        change = _coerce(name, value)
        self._change(lambda tx: self._set(tx, *change))

    def update(self, other: Any = (), /, **kwargs: Any) -> None:
        """Assign many variables at once, in the open transaction or in one of their own."""
        self._check_open()
        pairs = other.items() if isinstance(other, (dict, Mapping)) else other
        changes = [_coerce(name, value) for name, value in [*pairs, *kwargs.items()]]

        def apply(tx: _Tx) -> None:
            for name, kind, data in changes:
                self._set(tx, name, kind, data)

        self._change(apply)

    def _set(self, tx: _Tx, name: str, kind: str, data: Any) -> None:
        work = self._work
        old = work.get(name)
        if kind == "scalar":
            # a scalar's entry is final here: the committed one if the value is the same (it keeps
            # its version, and its encoded metadata), else a new version
            committed = self._meta.vars.get(name)
            if committed is None:
                work[name] = Entry("scalar", 1, value=data)
            elif committed.kind == "scalar" and _same_scalar(committed.value, data):
                work[name] = committed
            else:
                work[name] = Entry("scalar", committed.version + 1, value=data)
            if old is not None and old.kind != "scalar":
                self._drop_block(tx, old)
        elif kind == "array" and tx.reserved and self._adopt(tx, name, data, old):
            pass  # the value was computed in a reserved block: it becomes the variable's
        elif old is not None and kind == "array" and self._is_live_block_view(tx, old, data):
            pass  # the value already is the variable's writable block (see empty())
        elif (kind == "array" and old is not None and old.kind == "array" and self.tx_mode == "undo"
              and old.dtype == DTYPE_NAMES[data.dtype] and old.shape == data.shape):
            self._protect(tx, name, old)
            _copy(self._typed(old), data)
        else:
            self._put_block(tx, name, kind, data, old)
        tx.touched.add(name)

    def __delitem__(self, name: str) -> None:
        self._check_open()
        if name not in self._tx_vars():
            raise KeyError(name)
        self._change(lambda tx: self._delete(tx, name))

    def _delete(self, tx: _Tx, name: str) -> None:
        entry = self._work.pop(name)
        if entry.has_block:
            self._drop_block(tx, entry)
        tx.touched.add(name)

    def __iter__(self) -> Iterator[str]:
        self._check_open()
        return iter(list(self._tx_vars()))

    def __len__(self) -> int:
        self._check_open()
        return len(self._tx_vars())

    def __contains__(self, name: object) -> bool:
        self._check_open()
        return name in self._tx_vars()

    def empty(self, name: str, shape: int | Iterable[int], dtype: Any = np.float64) -> _Array:
        """A writable array variable ``name`` to compute into, inside a transaction; its contents
        are undefined until you write them (like ``np.empty``).

        This is how state can live on the shelf with no copy at all:
        ``np.dot(a, b, out=shelf.empty("c", (n, n)))``. It is a fresh block (whatever ``tx_mode``)
        that replaces ``name`` at commit, so the old value stays readable until then.
        """
        tx = self._open_tx("empty() hands out an array to fill")
        new_shape = (shape,) if isinstance(shape, int) else tuple(map(int, shape))
        dt, dtype_name = _native(dtype)
        self._mark_begun(tx)
        nbytes = math.prod(new_shape) * dt.itemsize
        entry = self._fresh_block(tx, name, "array", dtype_name, new_shape, nbytes, self._work.get(name))
        tx.touched.add(name)
        return self._view(name, entry)

    def reserve(self, shape: int | Iterable[int], dtype: Any = np.float64) -> _Array:
        """A writable array in a fresh block, inside a transaction, for no variable yet: assigning
        it to one in the same transaction (``shelf[name] = a``, ``update``) makes it that
        variable's value without a copy. Unassigned at the end of the transaction, it is freed.

        For loops whose next state has the shapes of the current one: reserving its blocks when
        the iteration's transaction begins takes the allocations off the computation's path.
        """
        tx = self._open_tx("reserve() hands out an array to fill")
        new_shape = (shape,) if isinstance(shape, int) else tuple(map(int, shape))
        dt, dtype_name = _native(dtype)
        self._mark_begun(tx)
        offset = self._alloc_block(math.prod(new_shape) * dt.itemsize, None)
        tx.new_blocks.add(offset)
        view: _Array = np.ndarray(new_shape, dt, buffer=self._owner, offset=offset)
        ref = weakref.ref(view)
        self._views[offset] = [ref]
        tx.opened.append(ref)
        tx.reserved[id(view)] = (view, Entry("array", 0, dtype_name, new_shape, offset, view.nbytes),
                                 view.strides)
        return view

    def _adopt(self, tx: _Tx, name: str, data: _Array, old: Entry | None) -> bool:
        """Make ``data``, if it is an array from :meth:`reserve` (its shape, strides and dtype
        unchanged), ``name``'s value."""
        held = tx.reserved.get(id(data))
        if held is None or held[0] is not data:
            return False
        _, entry, strides = held
        if data.shape != entry.shape or data.strides != strides or DTYPE_NAMES.get(data.dtype) != entry.dtype:
            return False
        del tx.reserved[id(data)], held
        if old is not None:
            entry = Entry("array", old.version, entry.dtype, entry.shape, entry.offset, entry.nbytes)
        self._work[name] = entry
        if old is not None and old.has_block:
            self._drop_block(tx, old)
        return True

    def _drop_reserved(self, tx: _Tx) -> None:
        """Free the reserved blocks nobody adopted (pinned while their arrays are alive)."""
        offsets = [entry.offset for _, entry, _ in tx.reserved.values()]
        tx.reserved.clear()
        for offset in offsets:
            tx.new_blocks.discard(offset)
            self._release(offset)

    def _open_tx(self, what: str) -> _Tx:
        self._check_open()
        if self._tx is None:
            raise ShelfError(f"{what} inside a transaction: call it within `with shelf.transaction():`")
        return self._tx

    def resize(self, name: str, shape: int | Iterable[int]) -> None:
        """Give array ``name`` a new shape; its leading bytes are kept, new elements are zero."""
        self._check_open()
        new_shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if self._tx_vars()[name].kind != "array":
            raise ShelfError(f"resize works on arrays; {name!r} is a {self._tx_vars()[name].kind}")
        old = self._tx_vars()[name]
        fresh = np.zeros(new_shape, dtype=NUMERIC_DTYPES[old.dtype])
        keep = min(fresh.size, int(np.prod(old.shape, dtype=np.int64)))
        fresh.reshape(-1)[:keep] = self._typed(old).reshape(-1)[:keep]
        self._change(lambda tx: self._set(tx, name, "array", fresh))

    # ------------------------------------------------------------------ information

    def info(self, name: str) -> VarInfo:
        """Kind, dtype, shape, size in bytes, version and block offset of variable ``name``."""
        self._check_open()
        e = self._tx_vars()[name]
        return VarInfo(name, e.kind, e.dtype, e.shape, e.nbytes, e.version, e.offset)

    @property
    def seq(self) -> int:
        """Number of the newest committed metadata (every commit or rollback increments it)."""
        return self._meta.seq

    @property
    def last_transaction(self) -> dict[str, Any]:
        """``{"seq", "time", "changed", "deleted"}`` of the newest committed transaction."""
        return dict(self._meta.tx)

    @property
    def metadata(self) -> Meta:
        """The committed metadata (variables, last transaction and rollback, loop layout), as the
        next commit would encode it: for tools and tests; do not change it."""
        return self._meta

    @property
    def size(self) -> int:
        return self._meta.size

    @property
    def data_bytes(self) -> int:
        """Bytes of the arena's data region: its size less the superblock, undo records and
        metadata slots."""
        return self._meta.size - self._sb.data_start

    @property
    def used(self) -> int:
        """Bytes of the arena's data region in use (including undo copies of an open transaction)."""
        return self._alloc.used

    @property
    def durability(self) -> str:
        return self._arena.durability

    @property
    def map_sync(self) -> bool:
        """True when the file is mapped with MAP_SYNC (a DAX filesystem)."""
        return self._arena.map_sync

    @property
    def in_transaction(self) -> bool:
        return self._tx is not None

    # ------------------------------------------------------------------ transactions

    def transaction(self, *names: str | Iterable[str]) -> Transaction:
        """All changes inside ``with shelf.transaction(...)`` commit together or not at all.

        With ``names``, only those arrays may be written in place through views (their old bytes
        are saved to the undo log now; views of other arrays stay read-only); an empty list
        (``transaction([])``) allows no in-place writes at all. Without names, every array you
        hold a view of, or fetch inside the block, is saved. Assignments, deletions, resizes and
        ``empty`` through the shelf are always covered. Transactions do not nest.
        """
        scope: set[str] = set()
        for item in names:
            scope.update([item] if isinstance(item, str) else item)
        return Transaction(self, frozenset(scope) if names else None)

    def _begin(self, scope: frozenset[str] | None) -> _Tx:
        self._check_open()
        if self._tx is not None:
            raise ShelfError("a transaction is already open on this shelf; transactions do not nest: "
                             "do the work inside the open one")
        if self._loop is not None and self._loop.in_iteration:
            raise ShelfError("a loop iteration is in progress on this shelf: commit() or abort() it "
                             "before starting a transaction")
        if self._pinned:
            self._sweep_pins()
        tx = self._tx = _Tx(self._meta.seq + 1, scope)
        self._work = dict(self._meta.vars)
        try:
            if scope is not None:
                for name in sorted(scope):
                    entry = self._work.get(name)
                    if entry is None or entry.kind != "array":
                        raise ShelfError(f"transaction({name!r}): no array named {name!r} on the shelf; "
                                         "create it first or leave it out of the list")
                    self._protect(tx, name, entry)
            else:
                for name, entry in self._work.items():
                    if entry.kind == "array" and self._live_views(entry.offset):
                        self._protect(tx, name, entry)
        except BaseException as exc:
            self._abort(f"{type(exc).__name__}: {exc}")
            raise
        return tx

    def _commit(self) -> None:
        tx = self._tx
        assert tx is not None
        if tx.reserved:
            self._drop_reserved(tx)
        if not tx.began:
            self._end()
            return
        meta, work = self._meta, self._work
        try:
            changed, deleted = [], []
            blocks_written = False
            committed_vars, mv = meta.vars, self._mv
            for name in tx.touched:
                old, entry = committed_vars.get(name), work.get(name)
                if entry is None:
                    if old is not None:
                        deleted.append(name)
                    continue
                if entry.kind != "scalar":  # (a scalar's entry is final when it is set)
                    digest = xxhash.xxh3_64_intdigest(mv[entry.offset : entry.offset + entry.nbytes])
                    work[name] = entry = _sealed(old, entry, digest)
                    blocks_written = True
                if old is None or entry.version != old.version:
                    changed.append(name)
            if blocks_written:
                self._arena.sync()
            if _ARMED:
                faults.reached("shelf_before_meta")
            changed.sort()
            deleted.sort()
            info = commit_record(tx.seq, time.time(), changed, deleted)
            layout = meta.loop if meta.loop is not None and loops.intact(meta.loop, work) else None
            committed = Meta(tx.seq, meta.size, work, info, meta.rollback, layout)
            self._write_meta(committed, commit=True)
        except BaseException as exc:
            self._abort(f"commit failed: {type(exc).__name__}: {exc}")
            raise
        if _ARMED:
            faults.reached("shelf_after_meta")
        if meta.loop is not None and committed.loop is None:
            self._drop_loop(meta, f"transaction {tx.seq} changed its variables")
        self._meta = committed
        for offset in [*tx.undo.values(), *tx.freed]:
            self._release(offset)
        self._end()

    def _abort(self, reason: str) -> None:
        """Undo an open transaction in this process (after an exception inside it)."""
        tx = self._tx
        if tx is None:
            return
        try:
            if tx.began:
                undo = tuple(Record(Record.UNDO, tx.seq, t, self._meta_size_of(t), s)
                             for t, s in tx.undo.items())
                restored = recovery.restore(self._mv, self._meta, undo, self.path)
                self._arena.sync()
                note = {"tx": tx.seq, "reason": reason[:500], "time": time.time(), "restored": restored}
                self._write_meta(replace(self._meta, seq=tx.seq, rollback=note))
                self._meta = replace(self._meta, seq=tx.seq, rollback=note)
        except BaseException as exc:
            self._broken = f"rolling back transaction {tx.seq} failed ({type(exc).__name__}: {exc})"
            self._end()
            raise
        tx.reserved.clear()  # (their arrays die here unless held: their blocks are free, not pinned)
        for offset in [*tx.undo.values(), *tx.new_blocks]:
            self._release(offset)
        self._end()

    def _end(self) -> None:
        tx, self._tx = self._tx, None
        self._work = self._meta.vars
        for ref in tx.opened if tx is not None else ():
            view = ref()
            if view is not None:
                view.flags.writeable = False

    def _change(self, operation: Callable[[_Tx], None]) -> None:
        """Run a change in the open transaction, or in a transaction of its own."""
        if self._tx is not None:
            self._mark_begun(self._tx)
            operation(self._tx)
            return
        with Transaction(self, frozenset()) as transaction:  # covers only what goes through the shelf
            assert transaction._tx is not None
            self._mark_begun(transaction._tx)
            operation(transaction._tx)

    def _mark_begun(self, tx: _Tx) -> None:
        if not tx.began:
            at = self._sb.record_off
            self._mv[at : at + RECORD_BYTES] = pack_record(Record.BEGIN, tx.seq, when=time.time())
            tx.began = True
            if _ARMED:
                faults.reached("shelf_after_begin")

    def _protect(self, tx: _Tx, name: str, entry: Entry) -> None:
        """Make ``entry``'s block safe to overwrite in place: save its committed bytes first."""
        if entry.offset in tx.undo or entry.offset in tx.new_blocks:
            return
        self._mark_begun(tx)
        index = len(tx.undo) + 1
        if index >= self._sb.record_size // RECORD_BYTES:
            raise ShelfError(f"a transaction can change at most {index - 1} committed variables in place; "
                             "split it, or assign new values instead of writing in place")
        saved = self._alloc_block(entry.nbytes, name, "the undo copy of ")
        tx.undo[entry.offset] = saved
        self._u8[saved : saved + entry.nbytes] = self._u8[entry.offset : entry.offset + entry.nbytes]
        at = self._sb.record_off + index * RECORD_BYTES
        self._mv[at : at + RECORD_BYTES] = pack_record(Record.UNDO, tx.seq, entry.offset, entry.nbytes, saved)
        self._arena.sync()  # the saved copy and its record are durable before the block changes
        if _ARMED:
            faults.reached("shelf_after_undo")
        tx.touched.add(name)
        if self._writable(name, entry):
            for ref in self._views.get(entry.offset, ()):
                view = ref()
                if view is not None and not view.flags.writeable:
                    view.flags.writeable = True
                    tx.opened.append(ref)

    def _put_block(self, tx: _Tx, name: str, kind: str, data: Any, old: Entry | None) -> None:
        """Write ``data`` into a fresh block and point ``name`` at it (a shadow copy)."""
        if kind == "array":
            entry = self._fresh_block(tx, name, kind, DTYPE_NAMES[data.dtype], tuple(data.shape),
                                      int(data.nbytes), old)
            _copy(self._typed(entry), data)
        else:
            entry = self._fresh_block(tx, name, kind, "", (), len(data), old)
            self._mv[entry.offset : entry.offset + entry.nbytes] = data

    def _fresh_block(self, tx: _Tx, name: str, kind: str, dtype: str, shape: tuple[int, ...], nbytes: int,
                     old: Entry | None) -> Entry:
        """Point ``name`` at a newly allocated block (the old one is freed at commit)."""
        offset = self._alloc_block(nbytes, name)
        tx.new_blocks.add(offset)
        entry = Entry(kind, old.version if old else 0, dtype, shape, offset, nbytes)  # type: ignore[arg-type]
        self._work[name] = entry
        if old is not None and old.has_block:
            self._drop_block(tx, old)
        return entry

    def _drop_block(self, tx: _Tx, entry: Entry) -> None:
        if entry.offset in tx.new_blocks:
            self._set_views_readonly(entry.offset)
            tx.new_blocks.discard(entry.offset)
            self._release(entry.offset)
        else:
            if entry.offset in tx.undo:  # (only blocks of this transaction have writable views)
                self._set_views_readonly(entry.offset)
            tx.freed.append(entry.offset)

    def _write_meta(self, meta: Meta, commit: bool = False) -> None:
        """Write ``meta`` into slot ``seq % 2`` (never the newest valid one) and flush: the commit
        (``commit``: ``meta.tx`` is the :func:`commit_record` of the transaction being committed)."""
        blob = encode_meta_slot(meta.seq, self._encoder.encode(meta, commit))
        if len(blob) > self._sb.slot_size:
            raise ShelfFullError(
                f"the shelf's metadata ({len(blob)} bytes) no longer fits its slot "
                f"({self._sb.slot_size} bytes): too many variables. Delete some, or keep them in a "
                "new shelf created with a larger size (slots grow with the size)."
            )
        start = self._sb.slot(meta.seq % 2)
        if _ARMED:
            faults.write_in_halves(self._mv, start, blob, "shelf_mid_meta")
        else:
            self._mv[start : start + len(blob)] = blob
        self._arena.sync()

    # ------------------------------------------------------------------ loops

    def loop(self, *names: str | Iterable[str]) -> loops.Loop:
        """The lean commit path for an iterative algorithm over variables ``names`` (already on the
        shelf: numeric arrays, and bool/int/float scalars), as a :class:`~crashsafe.shelf.loop.Loop`.

        The first call gives each array a spare block (the shelf must have room for a second copy
        of them) and records the loop in the metadata, in one commit; reopening the shelf and
        calling ``loop`` with the same names resumes it. A transaction that replaces, deletes or
        retypes one of its variables ends the loop (its blocks are freed), as does ``loop.end()``.
        """
        self._check_open()
        if self._tx is not None:
            raise ShelfError("loop() inside a transaction: start the loop outside it")
        wanted: list[str] = []
        for item in names:
            for name in [item] if isinstance(item, str) else item:
                if name not in wanted:
                    wanted.append(name)
        if not wanted:
            raise ValueError("loop() needs the names of the variables the loop changes")
        current = self._loop
        if current is not None and set(current.names) == set(wanted):
            return current
        if current is not None and current.in_iteration:
            raise ShelfError("a loop iteration is in progress: commit() or abort() it before starting "
                             "another loop")
        layout = self._meta.loop
        if layout is None or set(layout.names) != set(wanted):
            layout = self._new_loop(wanted)
        if current is not None:
            current._end(f"replaced by a loop over {wanted}")
        self._loop = loops.Loop(self, layout)
        return self._loop

    def _new_loop(self, names: list[str]) -> LoopLayout:
        """Lay out a loop over ``names`` and commit it (replacing the shelf's previous loop)."""
        meta = self._meta
        arrays, scalars = [], []
        for name in names:
            entry = meta.vars.get(name)
            if entry is None:
                raise ShelfError(f"loop(): there is no variable {name!r} on the shelf; assign its first "
                                 f"value (shelf[{name!r}] = ...) before starting the loop")
            if entry.kind == "array":
                arrays.append((name, entry))
            elif entry.kind == "scalar" and loops.is_loop_scalar(entry.value):
                scalars.append((name, scalar_type(entry.value)))
            else:
                what = f"a {scalar_type(entry.value)} scalar" if entry.kind == "scalar" else f"a {entry.kind}"
                raise ShelfError(f"loop(): {name!r} is {what}; a loop commits numeric arrays and bool, "
                                 "int (64-bit) and float scalars. Leave it out of the loop and change it in "
                                 "a transaction")
        if len(names) > LOOP_LIMIT:
            raise ShelfError(f"loop(): a loop has at most {LOOP_LIMIT} variables, got {len(names)}")
        seq = meta.seq + 1
        taken: list[int] = []
        try:
            spares = []
            for name, entry in arrays:
                taken.append(self._alloc_block(entry.nbytes, name, "the loop's spare of "))
                spares.append((name, entry.offset, taken[-1]))
            layout = LoopLayout(seq, tuple(spares), tuple(scalars), 0)
            taken.append(self._alloc_block(layout.records_bytes, "loop records", "the "))
            layout = replace(layout, records=taken[-1])
            info = commit_record(seq, time.time(), [], [])
            committed = Meta(seq, meta.size, meta.vars, info, meta.rollback, layout)
            self._write_meta(committed, commit=True)
        except BaseException:
            for offset in taken:
                self._alloc.release(offset)
            raise
        if meta.loop is not None:
            self._drop_loop(meta, f"replaced by a loop over {names}")
        self._meta = committed
        return layout

    def _end_loop(self, loop: loops.Loop) -> None:
        """``loop.end()``: commit the metadata without the loop, and free its spares and records."""
        if loop.ended is not None:
            return
        self._check_open()
        if self._tx is not None:
            raise ShelfError("loop.end() inside a transaction: end the loop outside it")
        loop.abort()
        meta = self._meta
        seq = meta.seq + 1
        committed = replace(meta, seq=seq, tx=commit_record(seq, time.time(), [], []), loop=None)
        self._write_meta(committed, commit=True)
        self._drop_loop(meta, "loop.end() was called")
        self._meta = committed

    def _drop_loop(self, before: Meta, reason: str) -> None:
        """After metadata without ``before``'s loop was committed: end the loop object and free the
        loop's own blocks (its spares in ``before`` and its records)."""
        if self._loop is not None:
            self._loop._end(reason)
            self._loop = None
        assert before.loop is not None
        for offset, _ in before.loop.blocks(before.vars):
            self._release(offset)

    def _block_view(self, name: str, entry: Entry, offset: int) -> _Array:
        """The read-only view of block ``offset`` shaped as array ``entry`` (registered as views are)."""
        return self._view(name, entry._replace(offset=offset))

    # ------------------------------------------------------------------ blocks and views

    def _alloc_block(self, nbytes: int, name: str | None, role: str = "") -> int:
        offset = self._alloc.alloc(nbytes)
        if offset is None:
            self._sweep_pins()
            offset = self._alloc.alloc(nbytes)
        if offset is None:
            data_bytes = self._meta.size - self._sb.data_start
            raise ShelfFullError(
                f"the shelf {self.path} is full: no free block for {role}{name or 'a reserved array'!r} "
                f"({nbytes} bytes; the "
                f"largest free block has {self._alloc.largest_gap()} of {data_bytes} bytes). The "
                "transaction is rolled back and the shelf's data is intact. Delete variables, or "
                "reopen with a larger size= to grow the arena."
            )
        return offset

    def _release(self, offset: int) -> None:
        """Free a block now, or once the views still pointing into it are gone."""
        if self._live_views(offset):
            self._pinned.add(offset)
        else:
            self._views.pop(offset, None)
            self._alloc.release(offset)

    def _sweep_pins(self) -> None:
        for offset in list(self._pinned):
            if not self._live_views(offset):
                self._pinned.discard(offset)
                self._views.pop(offset, None)
                self._alloc.release(offset)

    def _live_views(self, offset: int) -> bool:
        refs = self._views.get(offset)
        if not refs:
            return False
        refs[:] = [r for r in refs if r() is not None]
        return bool(refs)

    def _set_views_readonly(self, offset: int) -> None:
        for ref in self._views.get(offset, ()):
            view = ref()
            if view is not None and view.flags.writeable:
                view.flags.writeable = False

    def _typed(self, entry: Entry) -> _Array:
        return np.ndarray(entry.shape, NUMERIC_DTYPES[entry.dtype], buffer=self._mv, offset=entry.offset)

    def _view(self, name: str, entry: Entry) -> _Array:
        """The live view of ``entry``'s block (one per block and shape), writable iff the open
        transaction covers it; views made writable are listed to be made read-only at its end."""
        tx = self._tx
        if tx is not None and tx.scope is None and entry.offset not in tx.new_blocks:
            self._protect(tx, name, entry)
        writable = tx is not None and self._writable(name, entry)
        refs = self._views.get(entry.offset)
        if refs is None:
            refs = self._views[entry.offset] = []
        for ref in refs:
            view = ref()
            if view is not None and view.shape == entry.shape:
                flags = view.flags
                if flags.writeable == writable:
                    return view
                flags.writeable = writable
                break
        else:
            view = np.ndarray(entry.shape, NUMERIC_DTYPES[entry.dtype], buffer=self._owner,
                              offset=entry.offset)  # writable, as its buffer is
            ref = weakref.ref(view)
            refs.append(ref)
            if not writable:
                view.flags.writeable = False
        if writable and tx is not None:
            tx.opened.append(ref)
        return view

    def _writable(self, name: str, entry: Entry) -> bool:
        tx = self._tx
        if tx is None:
            return False
        if entry.offset in tx.new_blocks:
            return True
        return entry.offset in tx.undo and (tx.scope is None or name in tx.scope)

    def _is_live_block_view(self, tx: _Tx, entry: Entry, data: Any) -> bool:
        """Is ``data`` a view handed out for ``entry``'s block, writable in this transaction?"""
        if entry.kind != "array" or (entry.offset not in tx.new_blocks and entry.offset not in tx.undo):
            return False
        return any(ref() is data for ref in self._views.get(entry.offset, ()))

    def _digest(self, offset: int, nbytes: int) -> int:
        return xxhash.xxh3_64_intdigest(self._mv[offset : offset + nbytes])

    def _meta_size_of(self, offset: int) -> int:
        return next(e.nbytes for e in self._meta.vars.values() if e.has_block and e.offset == offset)

    def _tx_vars(self) -> dict[str, Entry]:
        return self._work if self._tx is not None else self._meta.vars

    # ------------------------------------------------------------------ lifecycle

    def _check_open(self) -> None:
        if self._arena.closed:
            raise ShelfError(f"the shelf {self.path} is closed; open it again with Shelf(path)")
        if self._broken is not None:
            raise ShelfError(f"the shelf {self.path} is unusable: {self._broken}. Close it and open it "
                             "again: opening recovers the last committed state")

    def _map_buffers(self) -> None:
        self._mv = memoryview(self._arena.mm)
        self._u8 = np.frombuffer(self._mv, dtype=np.uint8)
        # numpy keeps no buffer export of its own; this ctypes array does, and every view handed
        # out is based on it, so the mapping outlives every view (and derived view)
        self._owner: Any = (ctypes.c_char * self._arena.length).from_buffer(self._arena.mm)

    def _release_buffers(self) -> None:
        for refs in self._views.values():
            for ref in refs:
                view = ref()
                if view is not None:
                    view.flags.writeable = False
        with contextlib.suppress(AttributeError):
            del self._u8, self._owner
        with contextlib.suppress(AttributeError, BufferError):
            self._mv.release()

    def close(self) -> None:
        """Close the shelf (an open transaction or loop iteration is rolled back). Views stay
        readable until dropped."""
        if self._arena.closed:
            return
        if self._tx is not None:
            self._abort("the shelf was closed inside a transaction")
        if self._loop is not None:
            self._loop._end("the shelf was closed")
            self._loop = None
        self._release_buffers()
        self._arena.close()

    def __enter__(self) -> Shelf:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._arena.closed else f"{len(self._tx_vars())} variables, seq {self.seq}"
        return f"Shelf({str(self.path)!r}, {state})"


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


def _same_scalar(a: Any, b: Any) -> bool:
    return type(a) is type(b) and (a == b or (a != a and b != b))


def _copy(dst: _Array, src: _Array) -> None:
    if _ARMED and dst.size > 1:
        flat_dst, flat_src = dst.reshape(-1), np.ascontiguousarray(src).reshape(-1)
        half = flat_dst.size // 2
        np.copyto(flat_dst[:half], flat_src[:half], casting="equiv")
        faults.reached("shelf_mid_write")
        np.copyto(flat_dst[half:], flat_src[half:], casting="equiv")
    else:
        np.copyto(dst, src, casting="equiv")


# what empty()/reserve() accept as a dtype, resolved without numpy's dtype machinery
_DTYPE_ARGS: dict[Any, tuple[np.dtype[Any], str]] = {
    key: (dt, name) for name, dt in NUMERIC_DTYPES.items() for key in (name, dt, dt.type)}


def _native(dtype: Any) -> tuple[np.dtype[Any], str]:
    """(dtype, its shelf name) of a native numeric ``dtype`` argument; anything else is refused."""
    try:
        return _DTYPE_ARGS[dtype]
    except (KeyError, TypeError):
        pass
    dt = np.dtype(dtype)
    dtype_name = DTYPE_NAMES.get(dt)
    if dtype_name is None:
        raise UnsupportedStateError(f"dtype {dt} is not a native numeric dtype; a shelf holds bool, int, "
                                    "uint, float and complex arrays")
    return dt, dtype_name


_NATIVE_IDS = frozenset(map(id, DTYPE_NAMES))  # numpy's builtin dtypes are singletons: a quick test
_SCALAR_TYPES = (bool, int, float, complex)  # bool first: it is an int too
_PLAIN_SCALARS = frozenset([*_SCALAR_TYPES, type(None)])


def _coerce(name: str, value: Any) -> tuple[str, str, Any]:
    """(name, kind, data): arrays as ndarrays of a numeric dtype, str/bytes as bytes, scalars as
    plain Python values (a subclass such as an ``IntEnum`` is stored as its base type)."""
    if not isinstance(name, str) or not name:
        raise UnsupportedStateError(f"shelf variable names are non-empty strings, got {name!r}")
    if type(value) in _PLAIN_SCALARS:
        return name, "scalar", value
    if isinstance(value, np.ndarray) and (id(value.dtype) in _NATIVE_IDS or value.dtype in DTYPE_NAMES):
        return name, "array", value
    return name, *_coerce_other(name, value)


def _coerce_other(name: str, value: Any) -> tuple[str, Any]:
    if scalar_ok(value):
        base = next(t for t in _SCALAR_TYPES if isinstance(value, t))  # (None took the fast path)
        return "scalar", base(value)
    if isinstance(value, str):
        return "str", value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes", bytes(value)
    if is_tensor(value):
        value = value.detach().cpu()
        try:
            value = value.numpy()
        except TypeError as exc:
            raise UnsupportedStateError(f"shelf[{name!r}]: torch dtype {value.dtype} has no numpy "
                                        f"equivalent ({exc}); convert it first") from None
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if not isinstance(value, np.ndarray):
        raise UnsupportedStateError(
            f"shelf[{name!r}]: cannot store a {type(value).__name__}; a shelf holds numpy arrays (or "
            "torch tensors), bool/int/float/complex/None, str and bytes"
        )
    native = value.dtype.newbyteorder("=")
    if native.name not in NUMERIC_DTYPES or NUMERIC_DTYPES[native.name] != native:
        raise UnsupportedStateError(
            f"shelf[{name!r}]: dtype {value.dtype} is not numeric; a shelf holds bool, int, uint, float "
            "and complex arrays"
        )
    return "array", value if value.dtype == native else value.astype(native)
