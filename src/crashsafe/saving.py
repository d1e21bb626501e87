"""One step of one process: the state's snapshot, then every array encoded by the planner,
written, and committed.

The store's draft moves the bytes and runs its commit protocol; the planner picks codecs and delta
bases and keeps its chains only once the step is committed. The distributed counterpart, where
every rank writes its part and rank 0 commits, is :mod:`crashsafe.distributed.saving`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from crashsafe._cuda import is_cuda
from crashsafe.distributed.saving import PLAN_LATER, Listing, ReplicaPlanner
from crashsafe.encoding import SavePlanner
from crashsafe.format.manifest import Manifest, PayloadEntry
from crashsafe.state.snapshot import fast_copy
from crashsafe.state.staging import StagingPool, landed, view_bytes
from crashsafe.state.tree import ArrayLeaf, flatten
from crashsafe.storage.base import Store
from crashsafe.storage.writer import StepWriter

__all__ = ["SaveStats", "Snapshot", "save_step", "take_snapshot"]

Snapshot = tuple[dict[str, Any], list[ArrayLeaf], Iterable[np.ndarray[Any, Any]]]  # tree, leaves, their bytes


@dataclass(frozen=True)
class SaveStats:
    """Measured cost of one committed save (seconds and bytes)."""

    step: int
    stall: float
    persist: float
    raw_bytes: int
    stored_bytes: int


def save_step(
    store: Store,
    planner: SavePlanner,
    step: int,
    committed: frozenset[int],
    tree: dict[str, Any],
    leaves: list[ArrayLeaf],
    arrays: Iterable[np.ndarray[Any, Any]],
    metrics: dict[str, Any],
    info: dict[str, Any],
) -> Manifest:
    """Write and commit ``step``; ``committed`` are the steps committed before it (delta bases)."""
    writer = StepWriter(store, step)
    try:
        entries = []
        for leaf, array in zip(leaves, arrays, strict=True):
            encoded = planner.encode(leaf, array, step, committed)
            put = writer.write_payload(encoded.payload)
            config = encoded.codec.get_config()
            entries.append(
                PayloadEntry(
                    leaf.path,
                    leaf.kind,
                    leaf.dtype,
                    leaf.shape,
                    put.file,
                    put.offset,
                    put.nbytes,
                    put.xxh3,
                    config,
                    encoded.base,
                )
            )
        info = {**info, **planner.base_marks(e.base for e in entries if e.base is not None)}
        manifest = Manifest(step, time.time(), tree, tuple(entries), writer.files(), metrics, info)
        writer.commit(manifest)
    except BaseException:
        writer.abort()
        planner.reset()  # references were advanced in place for a step that never committed
        raise
    planner.committed(step, manifest.created)
    return manifest


def take_snapshot(
    state: object, store: Store, pool: StagingPool | None, replicas: ReplicaPlanner | None, *, checked: bool
) -> tuple[Callable[[], Snapshot], Listing | None]:
    """The state copied into ``pool`` for a background save (no pool: viewed in place, for a save
    that writes before it returns), as a function giving its snapshot; and, for a rank of a
    distributed save (``replicas``: its planner), the plan the ranks agreed (or PLAN_LATER: the plan
    is made in the background). Once a save ``checked`` the state in full, one process copies it in
    one walk and the background thread flattens the copy: the training thread pays for the copy,
    not for the checks. CUDA tensors' copies are issued on their devices' copy streams before it
    returns; the snapshot function waits for them (:meth:`StagingPool.settle`) before any byte is read."""
    if pool is not None and replicas is None and checked:
        copied = fast_copy(state, pool)  # None: a state it cannot judge, checked in full below
        if copied is not None:
            box = [copied]
            return lambda: _snapshot_of(box, pool), None
    tree, leaves = flatten(state)
    planned: Listing | None = None
    staged = leaves
    if replicas is not None and replicas.first:  # a rank copies only what it writes
        planned = replicas.plan(leaves, lambda i: view_bytes(leaves[i]), store)
        staged = [leaves[i] for i in planned.writes]
    elif replicas is not None:  # it copies everything; the plan is made from the copies
        planned = PLAN_LATER
    if pool is None:
        arrays = [view_bytes(leaf) for leaf in staged]
        return lambda: (tree, leaves, arrays), planned
    copies = pool.capture(staged)
    if replicas is None:
        return lambda: (tree, leaves, _arriving(pool, staged, copies)), planned
    return lambda: (tree, leaves, _landed(pool, staged, copies)), planned


def _landed(pool: StagingPool, leaves: list[ArrayLeaf], copies: list[Any]) -> list[np.ndarray[Any, Any]]:
    """The staged bytes of ``leaves``, once every device copy landed (a clone's: in its buffer)."""
    pool.settle()
    arrays = [landed(pool, leaf, copy) for leaf, copy in zip(leaves, copies, strict=True)]
    pool.release()
    return arrays


def _arriving(
    pool: StagingPool, leaves: list[ArrayLeaf], copies: list[Any]
) -> Iterator[np.ndarray[Any, Any]]:
    """The staged bytes of ``leaves`` in order, each once its device copy landed: the writer works
    on the first while later ones still cross the link. The clones go as soon as they landed."""
    pool.settle(every=False)
    copies[:] = [landed(pool, leaf, copy) for leaf, copy in zip(leaves, copies, strict=True)]
    for leaf, copy in zip(leaves, copies, strict=True):
        pool.ready(leaf.path)
        yield copy
    pool.release()


def _snapshot_of(box: list[Any], pool: StagingPool) -> Snapshot:
    """The snapshot of the copy ``fast_copy`` made (taken out of ``box``: once its clones landed,
    nothing holds them), its arrays each given once its device copy landed."""
    tree, leaves = flatten(box.pop(), check=False)  # the writer validates the manifest before its commit
    pool.settle(every=False)
    copies = [pool.landed(leaf.path) if is_cuda(leaf.source) else None for leaf in leaves]
    leaves = [
        leaf if copy is None else dataclasses.replace(leaf, source=copy)
        for leaf, copy in zip(leaves, copies, strict=True)
    ]
    if pool.waiting - {leaf.path for leaf in leaves}:  # a copy no path here names: wait for them all
        pool.release()

    def arrays() -> Iterator[np.ndarray[Any, Any]]:
        for leaf, copy in zip(leaves, copies, strict=True):
            pool.ready(leaf.path)
            yield view_bytes(leaf) if copy is None else copy
        pool.release()

    return tree, leaves, arrays()
