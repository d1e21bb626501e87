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

``Shelf`` is the user's door; the work is done by: :mod:`~crashsafe.shelf.tx` (one transaction's
changes: undo log, shadow blocks), :mod:`~crashsafe.shelf.committed` (the committed state and every
metadata write), :mod:`~crashsafe.shelf.blocks` (the mapped bytes: allocation, views, pins),
:mod:`~crashsafe.shelf.values` (what a value is stored as) and :mod:`~crashsafe.shelf.loop`
(the lean commit path of iterative algorithms).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

import crashsafe._faults as faults
from crashsafe._closing import Closing
from crashsafe._log import warn
from crashsafe._units import parse_size
from crashsafe.shelf.arena import Arena, Durability
from crashsafe.shelf.blocks import Blocks
from crashsafe.shelf.committed import CommittedState, create
from crashsafe.shelf.errors import CorruptShelfError, ShelfError, ShelfRecoveredWarning
from crashsafe.shelf.loop import Loop
from crashsafe.shelf.loop_record import intact
from crashsafe.shelf.meta import NUMERIC_DTYPES, Entry, Meta, commit_record
from crashsafe.shelf.recovery import RecoveryInfo
from crashsafe.shelf.tx import Tx, TxMode, shape_of
from crashsafe.shelf.values import coerce

__all__ = ["Shelf", "Transaction", "TxMode", "VarInfo"]

_ARMED = faults.SHELF_ARMED
_Array = np.ndarray[Any, Any]
_IN_TRANSACTION = "a transaction is open on this shelf; a loop iteration cannot run inside it"


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


class Transaction:
    """Context manager of one transaction: commits on normal exit, rolls back on an exception."""

    def __init__(self, shelf: Shelf, scope: frozenset[str] | None) -> None:
        self._shelf = shelf
        self._scope = scope
        self._tx: Tx | None = None

    def __enter__(self) -> Transaction:
        self._tx = self._shelf._begin(self._scope)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._shelf._tx is not self._tx:
            if exc is None:
                raise ShelfError(
                    "the shelf was closed inside this transaction, which was rolled back; "
                    "nothing was committed"
                )
            return
        if exc is None:
            self._shelf._commit()
        else:
            self._shelf._abort(f"{type(exc).__name__}: {exc}")


class Shelf(Closing, MutableMapping[str, Any]):
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
        self._tx: Tx | None = None
        self._broken: str | None = None
        self._loop_host: _LoopHost | None = None  # (made by the first loop)
        wanted = parse_size(size) if size is not None else None
        if not self.path.exists():
            if wanted is None:
                raise ShelfError(
                    f"the shelf {self.path} does not exist; pass size= (e.g. '1GiB') to create it"
                )
            create(self.path, wanted)
        self._arena = Arena.open(self.path, durability)
        self._blocks = Blocks(self._arena, self.path)
        try:
            self._open(wanted, verify)
        except BaseException:
            self._blocks.unmap()
            self._arena.close()
            raise

    # ------------------------------------------------------------------ opening

    def _open(self, wanted: int | None, verify: bool) -> None:
        state = self._state = CommittedState.read(self._arena, self._blocks, self.path)
        self.recovered = found = state.recover()
        if found is not None and found.lost:
            first = found.seq - found.lost + 1
            which = f"transaction {first}" if found.lost == 1 else f"transactions {first}..{found.seq}"
            warn(
                f"shelf {self.path}: {which} (loop iterations) committed, but the loop's newest record "
                f"is damaged (it fails its checksum): the shelf holds transaction {first - 1}, the newest "
                "it can prove, and what came after it is lost. Run those iterations again, or restore the "
                "file from a copy.",
                ShelfRecoveredWarning,
            )
        elif found is not None:
            warn(
                f"shelf {self.path}: transaction {found.seq} did not commit (a crash interrupted "
                f"it, or its metadata is damaged) and has been rolled back ({len(found.restored)} "
                f"variables restored in place); the shelf holds the state committed before it.",
                ShelfRecoveredWarning,
            )
        if verify:
            self.verify()
        if wanted is not None and wanted > state.meta.size:
            state.grow(wanted)
        self._blocks.track(state.sb.data_start, state.meta.size, state.blocks_in_use())

    def verify(self) -> None:
        """Check every variable's bytes against its committed checksum; raise on any mismatch."""
        self._check_open()
        if self._tx is not None:
            raise ShelfError("verify() checks committed data; call it outside a transaction")
        bad = [
            name
            for name, e in self._state.meta.vars.items()
            if e.has_block and self._blocks.digest(e.offset, e.nbytes) != e.digest
        ]
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
        mv = self._blocks.mv
        if entry.kind == "bytes":
            return bytes(mv[entry.offset : entry.offset + entry.nbytes])
        if entry.kind == "str":
            return bytes(mv[entry.offset : entry.offset + entry.nbytes]).decode()
        tx = self._tx
        return tx.view(name, entry) if tx is not None else self._blocks.view(entry)

    def __setitem__(self, name: str, value: Any) -> None:
        self._check_open()
        change = coerce(name, value)
        self._change(lambda tx: tx.set(*change))

    def update(self, other: Any = (), /, **kwargs: Any) -> None:
        """Assign many variables at once, in the open transaction or in one of their own."""
        self._check_open()
        pairs = other.items() if isinstance(other, (dict, Mapping)) else other
        changes = [coerce(name, value) for name, value in [*pairs, *kwargs.items()]]

        def apply(tx: Tx) -> None:
            for name, kind, data in changes:
                tx.set(name, kind, data)

        self._change(apply)

    def __delitem__(self, name: str) -> None:
        self._check_open()
        if name not in self._tx_vars():
            raise KeyError(name)
        self._change(lambda tx: tx.delete(name))

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
        return self._open_tx("empty() hands out an array to fill").empty(name, shape, dtype)

    def reserve(self, shape: int | Iterable[int], dtype: Any = np.float64) -> _Array:
        """A writable array in a fresh block, inside a transaction, for no variable yet: assigning
        it to one in the same transaction (``shelf[name] = a``, ``update``) makes it that
        variable's value without a copy. Unassigned at the end of the transaction, it is freed.

        For loops whose next state has the shapes of the current one: reserving its blocks when
        the iteration's transaction begins takes the allocations off the computation's path.
        """
        return self._open_tx("reserve() hands out an array to fill").reserve(shape, dtype)

    def _open_tx(self, what: str) -> Tx:
        self._check_open()
        if self._tx is None:
            raise ShelfError(f"{what} inside a transaction: call it within `with shelf.transaction():`")
        return self._tx

    def resize(self, name: str, shape: int | Iterable[int]) -> None:
        """Give array ``name`` a new shape; its leading bytes are kept, new elements are zero."""
        self._check_open()
        new_shape = shape_of(shape)
        old = self._tx_vars()[name]
        if old.kind != "array":
            raise ShelfError(f"resize works on arrays; {name!r} is a {old.kind}")
        fresh = np.zeros(new_shape, dtype=NUMERIC_DTYPES[old.dtype])
        keep = min(fresh.size, int(np.prod(old.shape, dtype=np.int64)))
        fresh.reshape(-1)[:keep] = self._blocks.typed(old).reshape(-1)[:keep]
        self._change(lambda tx: tx.set(name, "array", fresh))

    # ------------------------------------------------------------------ information

    def info(self, name: str) -> VarInfo:
        """Kind, dtype, shape, size in bytes, version and block offset of variable ``name``."""
        self._check_open()
        e = self._tx_vars()[name]
        return VarInfo(name, e.kind, e.dtype, e.shape, e.nbytes, e.version, e.offset)

    @property
    def seq(self) -> int:
        """Number of the newest committed metadata (every commit or rollback increments it)."""
        return self._state.meta.seq

    @property
    def last_transaction(self) -> dict[str, Any]:
        """``{"seq", "time", "changed", "deleted"}`` of the newest committed transaction."""
        return dict(self._state.meta.tx)

    @property
    def metadata(self) -> Meta:
        """The committed metadata (variables, last transaction and rollback, loop layout), as the
        next commit would encode it: for tools and tests; do not change it."""
        return self._state.meta

    @property
    def size(self) -> int:
        return self._state.meta.size

    @property
    def data_bytes(self) -> int:
        """Bytes of the arena's data region: its size less the superblock, undo records and
        metadata slots."""
        return self._state.meta.size - self._state.sb.data_start

    @property
    def used(self) -> int:
        """Bytes of the arena's data region in use (including undo copies of an open transaction)."""
        return self._blocks.used

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

    def _tx_vars(self) -> dict[str, Entry]:
        return self._tx.work if self._tx is not None else self._state.meta.vars

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

    def _begin(self, scope: frozenset[str] | None) -> Tx:
        self._check_open()
        if self._tx is not None:
            raise ShelfError(
                "a transaction is already open on this shelf; transactions do not nest: "
                "do the work inside the open one"
            )
        if self._state.loop is not None and self._state.loop.in_iteration:
            raise ShelfError(
                "a loop iteration is in progress on this shelf: commit() or abort() it "
                "before starting a transaction"
            )
        if self._blocks.pinned:
            self._blocks.sweep_pins()
        meta = self._state.meta
        tx = self._tx = Tx(meta.seq + 1, scope, meta.vars, self._blocks, self._state.sb, self.tx_mode)
        if self._loop_host is not None:
            self._loop_host.busy = _IN_TRANSACTION
        try:
            tx.cover()
        except BaseException as exc:
            self._abort(f"{type(exc).__name__}: {exc}")
            raise
        return tx

    def _commit(self) -> None:
        tx = self._tx
        assert tx is not None
        if tx.reserved:
            tx.drop_reserved()
        if not tx.began:
            self._end()
            return
        state = self._state
        meta = state.meta
        try:
            changed, deleted = tx.seal()
            if _ARMED:
                faults.reached("shelf_before_meta")
            info = commit_record(tx.seq, time.time(), changed, deleted)
            layout = meta.loop if meta.loop is not None and intact(meta.loop, tx.work) else None
            committed = Meta(tx.seq, meta.size, tx.work, info, meta.rollback, layout)
            state.write(committed, commit=True)
        except BaseException as exc:
            self._abort(f"commit failed: {type(exc).__name__}: {exc}")
            raise
        if _ARMED:
            faults.reached("shelf_after_meta")
        if meta.loop is not None and committed.loop is None:
            state.drop_loop(meta, f"transaction {tx.seq} changed its variables")
        state.meta = committed
        for offset in tx.committed_leftovers():
            self._blocks.release(offset)
        self._end()

    def _abort(self, reason: str) -> None:
        """Undo an open transaction in this process (after an exception inside it)."""
        tx = self._tx
        if tx is None:
            return
        try:
            if tx.began:
                self._state.roll_back(tx.seq, tx.undo_records(), reason[:500])
        except BaseException as exc:
            self._broken = f"rolling back transaction {tx.seq} failed ({type(exc).__name__}: {exc})"
            self._end()
            raise
        for offset in tx.rolled_back_leftovers():
            self._blocks.release(offset)
        self._end()

    def _end(self) -> None:
        tx, self._tx = self._tx, None
        if tx is not None:
            tx.close()
        if self._loop_host is not None:
            self._loop_host.busy = None if self._broken is None else self._unusable()

    def _change(self, operation: Callable[[Tx], None]) -> None:
        """Run a change in the open transaction, or in a transaction of its own."""
        if self._tx is not None:
            self._tx.mark_begun()
            operation(self._tx)
            return
        with Transaction(self, frozenset()) as transaction:  # covers only what goes through the shelf
            assert transaction._tx is not None
            transaction._tx.mark_begun()
            operation(transaction._tx)

    # ------------------------------------------------------------------ loops

    def loop(self, *names: str | Iterable[str]) -> Loop:
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
        if self._loop_host is None:
            self._loop_host = _LoopHost(self)
        return self._state.start_loop(self._loop_host, wanted)

    def _end_loop(self, loop: Loop) -> None:
        """``loop.end()``: commit the metadata without the loop, and free its spares and records."""
        if loop.ended is not None:
            return
        self._check_open()
        if self._tx is not None:
            raise ShelfError("loop.end() inside a transaction: end the loop outside it")
        loop.abort()
        self._state.end_loop()

    # ------------------------------------------------------------------ lifecycle

    def _check_open(self) -> None:
        if self._arena.closed or self._broken is not None:
            raise ShelfError(self._unusable())

    def _unusable(self) -> str:
        """Why the shelf cannot be used (it is closed, or a rollback failed)."""
        if self._arena.closed:
            return f"the shelf {self.path} is closed; open it again with Shelf(path)"
        return (
            f"the shelf {self.path} is unusable: {self._broken}. Close it and open it again: opening "
            "recovers the last committed state"
        )

    def close(self) -> None:
        """Close the shelf (an open transaction or loop iteration is rolled back). Views stay
        readable until dropped."""
        if self._arena.closed:
            return
        if self._tx is not None:
            self._abort("the shelf was closed inside a transaction")
        if self._state.loop is not None:
            self._state.loop.detach("the shelf was closed")
            self._state.loop = None
        self._blocks.unmap()
        self._arena.close()

    def __repr__(self) -> str:
        state = "closed" if self._arena.closed else f"{len(self._tx_vars())} variables, seq {self.seq}"
        return f"Shelf({str(self.path)!r}, {state})"


class _LoopHost:
    """The shelf as its loop sees it (:class:`~crashsafe.shelf.loop.LoopHost`); the shelf sets
    ``busy`` when a transaction begins and ends."""

    __slots__ = ("_shelf", "busy")

    def __init__(self, shelf: Shelf) -> None:
        self._shelf = shelf
        self.busy: str | None = None

    @property
    def buffer(self) -> memoryview:
        return self._shelf._blocks.mv

    @property
    def sync_fd(self) -> int | None:
        arena = self._shelf._arena
        return arena.fd if arena.durability == "power" else None

    def block_view(self, entry: Entry) -> _Array:
        return self._shelf._blocks.view(entry)

    def end_loop(self, loop: Loop) -> None:
        self._shelf._end_loop(loop)
