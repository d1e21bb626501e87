"""A save's snapshot: the state copied (or viewed) for the thread that writes it, and what a save
measured. Writing and committing it, for one process or many, is
:func:`crashsafe.distributed.saving.save_step`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from crashsafe._cuda import is_cuda
from crashsafe.distributed.saving import PLAN_LATER, Listing, ReplicaPlanner, Staged
from crashsafe.state.snapshot import fast_copy
from crashsafe.state.staging import StagingPool, landed, view_bytes
from crashsafe.state.tree import ArrayLeaf, flatten
from crashsafe.state.unchanged import ChangeWatch, Unchanged
from crashsafe.storage.base import Store

__all__ = ["SaveStats", "Snapshot", "take_snapshot"]

Snapshot = tuple[dict[str, Any], list[ArrayLeaf], Iterable[Staged]]  # tree, leaves, their bytes


@dataclass(frozen=True)
class SaveStats:
    """Measured cost of one committed save (seconds and bytes). ``setup``: the part of ``stall``
    spent allocating staging buffers that later saves do not pay again: a process's first save's,
    or one after a save that allocated none (a tensor that changed shape once); after a save that
    allocated too (shapes that change at every save), allocating recurs and is no setup."""

    step: int
    stall: float
    persist: float
    raw_bytes: int
    stored_bytes: int
    setup: float = 0.0

    @property
    def recurring_stall(self) -> float:
        """The stall a save of the same state pays again: ``stall`` less the one-time ``setup``."""
        return max(0.0, self.stall - self.setup)


def take_snapshot(
    state: object,
    store: Store,
    pool: StagingPool | None,
    replicas: ReplicaPlanner,
    watch: ChangeWatch,
    checked: bool,
    copy_all: bool = False,
) -> tuple[Callable[[], Snapshot], Listing]:
    """The state copied into ``pool`` for a background save (no pool: viewed in place, for a save
    that writes before it returns), as a function giving its snapshot; and the plan the ranks agreed
    in the save call, or PLAN_LATER (the plan, listing included, is made in the background: always
    for one process). Once a save ``checked`` the state in full, a state whose every array this
    process writes is copied in one walk and the background thread flattens the copy: the training
    thread pays for the copy, not for the checks. CUDA tensors' copies are issued on their devices'
    copy streams before it returns; the snapshot waits for each before its bytes are read. A tensor
    ``watch`` proves unchanged since the newest committed step is not copied: the snapshot gives its
    :class:`~crashsafe.state.unchanged.Unchanged` instead of its bytes. ``copy_all``: every array is
    copied, even one this rank will not write (a memory tier writes each rank's state whole)."""
    first = replicas.first and not copy_all
    if pool is not None and checked and not first:
        copied = fast_copy(state, pool, watch)  # None: a state it cannot judge, checked in full below
        if copied is not None:
            box, unchanged = [copied], pool.unchanged
            return lambda: _snapshot_of(box, pool, unchanged), PLAN_LATER
    tree, leaves = flatten(state)
    planned: Listing = PLAN_LATER  # every array copied; the plan is made from the copies
    staged = leaves
    if first:  # a rank copies only what it writes
        planned = replicas.plan(leaves, lambda i: view_bytes(leaves[i]), store)
        staged = [leaves[i] for i in planned.writes]
    if pool is None:
        arrays = _in_place(staged, watch)
        return lambda: (tree, leaves, arrays), planned
    copies = pool.capture(staged, watch)
    return lambda: (tree, leaves, _arriving(pool, staged, copies)), planned


def _in_place(leaves: list[ArrayLeaf], watch: ChangeWatch) -> list[Any]:
    """The leaves' bytes viewed where they are (a save that writes before it returns), each CPU
    tensor ``watch`` proves unchanged as its Unchanged."""
    watch.begin()
    watch.prehash([(leaf.path, leaf.source) for leaf in leaves if leaf.kind == "torch" and leaf.nbytes])
    arrays: list[Any] = []
    for leaf in leaves:
        viewed, found = view_bytes(leaf), None  # an Unchanged's bytes too: typed, for every codec
        if leaf.kind == "torch" and not is_cuda(leaf.source):
            found = watch.check(leaf.path, leaf.source, held=viewed, live=True)
            if found is None:
                watch.saw(leaf.path, leaf.source, buffer=None)
        arrays.append(viewed if found is None else found)
    return arrays


def _arriving(pool: StagingPool, leaves: list[ArrayLeaf], copies: list[Any]) -> Iterator[Staged]:
    """The staged bytes of ``leaves`` in order (an unchanged tensor's Unchanged), each once its
    device copy landed: the writer works on the first while later ones still cross the link. The
    clones go as soon as they landed."""
    pool.settle(every=False)
    copies[:] = [
        c if isinstance(c, Unchanged) else landed(pool, leaf, c)
        for leaf, c in zip(leaves, copies, strict=True)
    ]
    for leaf, copy in zip(leaves, copies, strict=True):
        pool.ready(leaf.path)
        yield copy
    pool.release()


def _snapshot_of(box: list[Any], pool: StagingPool, unchanged: dict[str, Unchanged]) -> Snapshot:
    """The snapshot of the copy ``fast_copy`` made (taken out of ``box``: once its clones landed,
    nothing holds them), its arrays each given once its device copy landed; the tensors it did not
    copy (``unchanged``) as their Unchanged."""
    tree, leaves = flatten(box.pop(), check=False)  # the writer validates the manifest before its commit
    pool.settle(every=False)
    copies = [pool.landed(leaf.path) if is_cuda(leaf.source) else None for leaf in leaves]
    leaves = [
        leaf if copy is None else dataclasses.replace(leaf, source=copy)
        for leaf, copy in zip(leaves, copies, strict=True)
    ]
    if pool.waiting - {leaf.path for leaf in leaves}:  # a copy no path here names: wait for them all
        pool.release()

    def arrays() -> Iterator[Staged]:
        for leaf, copy in zip(leaves, copies, strict=True):
            pool.ready(leaf.path)
            found = unchanged.get(leaf.path)
            yield found if found is not None else view_bytes(leaf) if copy is None else copy
        pool.release()

    return tree, leaves, arrays()
