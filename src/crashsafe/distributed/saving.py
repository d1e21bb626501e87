"""One step of any number of processes: every rank writes its part, rank 0 commits the whole, or
nobody does. One process alone (a :class:`~crashsafe.distributed.group.Solo` coordination) is rank
0 of 1: it plans in the background, writes the whole step as one part and commits it, in the format
of a single process (docs/format.md); every exchange below is then a no-op.

1. every rank describes its arrays (path, type, shape, shard placement, bytes) and rank 0 adds
   its listing of the committed steps and names the attempt; arrays that several ranks hold alike
   are hashed and the hashes exchanged; from the gathered offers every rank computes the same plan
   (:class:`ReplicaPlanner`, :mod:`crashsafe.distributed.plan`). Where the last plan had ranks
   skip much of what they hold (DDP), this runs in the save call, before the snapshot, and each
   rank copies only the arrays it writes (1/N of a DDP replica); otherwise (FSDP2) the save call
   copies every array and takes part in no exchange: the plan is made in the background;

Then in each rank's background persist thread (:func:`save_step`):

2. each rank encodes and writes the arrays it was given into its own file of the step's shared
   temporary place, and makes it durable (a raw payload hashed in step 1 keeps that hash as its
   checksum: hashed once, and when hashed in the save call, before the copy, so a faulty copy is
   caught when it is read);
3. every rank's payload entries, tree and file sizes go to rank 0, which writes the global manifest
   (per-rank trees pointing at the payloads they use) and commits it with the store's protocol
   (rename, or manifest last);
4. rank 0's outcome goes to every rank: all ranks see the step committed, or all see the error;
5. then rank 0 applies retention (the manager's): a deletion that fails is garbage left for later,
   never an error that would tell the ranks a committed step failed.

A rank that dies at any point makes the others fail at the next exchange with CoordinationError
(within the coordination timeout), and no step is committed: the temporary place is a leftover
that the next writer removes. Only the leader deletes a failed attempt's files: a rank that timed
out waiting must not delete its part while a slow leader may still be committing it. And no writer
deletes after its commit: a rank lost while the outcome goes out leaves the committed step intact.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from crashsafe.distributed.group import Coordination
from crashsafe.distributed.plan import Offer, Plan, assign
from crashsafe.encoding import SavePlanner
from crashsafe.errors import CoordinationError, CrashsafeError
from crashsafe.format.chunks import Chunks, hash_chunks
from crashsafe.format.manifest import Manifest, PayloadEntry, base_mark
from crashsafe.format.tree import ARRAY_NODES
from crashsafe.state.tree import ArrayLeaf
from crashsafe.state.unchanged import Unchanged
from crashsafe.storage.base import Store
from crashsafe.storage.writer import StepWriter

__all__ = ["PLAN_LATER", "Listing", "ReplicaPlanner", "StepPlan", "save_step"]

PLAN_FIRST_FROM = 1 << 20  # bytes a rank holds but does not write, from which saves plan first
# A raw shard's chunk checksums: a rank of a larger world reads and verifies only the chunks it
# needs (docs/format.md, "Chunk checksums"); ~5 KB of manifest per GiB of shards.
CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class Listing:
    """Rank 0's word on a save, on every rank: the committed steps and the attempt's name."""

    committed: frozenset[int]
    attempt: str


@dataclass(frozen=True)
class StepPlan(Listing):
    """What every rank agreed for a save: who writes what, and the checksums of this rank's
    arrays that it hashed to plan (a raw payload's checksum: the same bytes)."""

    plan: Plan
    writes: list[int]  # indices of this rank's arrays that it writes
    digests: dict[int, str | Chunks]  # array index -> its checksum, for the arrays hashed to plan


Staged = np.ndarray[Any, Any] | Unchanged  # an array's bytes in a snapshot, or the committed bytes it equals
PLAN_LATER = Listing(frozenset(), "")  # a save planned, listing included, in the background


_Described = tuple[str, str, int]  # an array as the other ranks see it: path, what it is, bytes


class ReplicaPlanner:
    """Plans each save of one rank: who writes what (step 1 of the module doc).

    Every rank sends what it holds (path, type, shape, shard placement, bytes); an array that no
    other rank holds alike (an FSDP2 shard) is its own rank's to write, unread. Arrays held alike
    by several ranks (a DDP replica's, each rank's RNG state) are hashed and their hashes exchanged:
    equal bytes are written once, by one holder. What every rank held at the last save is
    remembered: while a rank's arrays are unchanged it sends only the hashes of those held alike,
    so a steady run plans in one exchange (two after a change).

    Where it plans follows the last plan, which every rank knows alike: where ranks skip writing
    much of what they hold (DDP, or nothing known yet), in the save call, before the snapshot, so
    that each rank copies only what it writes; otherwise (FSDP2) every array is copied and the
    plan, listing included, is made from the copies in the background: the save call waits for no
    other rank (:data:`PLAN_LATER`).
    """

    def __init__(self, coord: Coordination) -> None:
        self.coord = coord
        self.first = coord.shared  # plan in the save call (the ranks agree on it at every plan)
        self._described: list[list[_Described]] | None = None  # every rank's arrays at the last save
        self._alike: list[list[int]] = []  # per rank: its arrays that other ranks held alike

    def plan(
        self, leaves: list[ArrayLeaf], bytes_of: Callable[[int], np.ndarray[Any, Any]], store: Store
    ) -> StepPlan:
        """The plan of a save whose arrays ``bytes_of(i)`` gives (the live ones, or their copies),
        with rank 0's listing of ``store`` and the attempt's name."""
        coord, last = self.coord, self._described
        if not coord.shared:  # one process writes every array it has: nothing to agree on or to hash
            writes = list(range(len(leaves)))
            whole = Plan({(0, i): (0, i) for i in writes}, (sum(leaf.nbytes for leaf in leaves),))
            return StepPlan(frozenset(store.steps()), "", whole, writes, {})
        self._described = None  # forgotten until this plan is agreed: a failed exchange leaves no memory
        described = [(leaf.path, repr((leaf.kind, leaf.dtype, leaf.shape, leaf.shard)), leaf.nbytes)
                     for leaf in leaves]  # fmt: skip
        same = last is not None and last[coord.rank] == described
        checksums = _Checksums(leaves, bytes_of)
        digests = {i: checksums.of(i) for i in self._alike[coord.rank]} if same else {}
        listing: Any = None
        if coord.leader:
            try:
                listing = ("ok", Listing(frozenset(store.steps()), secrets.token_hex(8)))
            except Exception as exc:  # every rank must hear of it, or the others would wait forever
                listing = ("error", exc)
        sent = None if same else described
        gathered = coord.all_gather((listing, sent, digests, last is not None), "planning a save")
        outcome = gathered[0][0]
        if outcome[0] == "error":
            error = outcome[1]
            raise error if isinstance(error, Exception) else CoordinationError(str(error))
        hashes = [rank_digests for _, _, rank_digests, _ in gathered]
        alike = self._alike
        forgot = not all(remembers for *_, remembers in gathered)  # a rank's plan failed: describe anew
        if forgot:
            held = coord.all_gather(described, "planning a save")
        else:
            assert last is not None
            held = [items if items is not None else last[r] for r, (_, items, _, _) in enumerate(gathered)]
        # a rank's arrays changed, or a rank forgot: which arrays several ranks hold alike, anew
        # (decided from what every rank sent, so every rank takes the same exchanges)
        if forgot or any(items is not None for _, items, _, _ in gathered):
            counts = Counter(item[:2] for items in held for item in items)
            alike = [[i for i, item in enumerate(items) if counts[item[:2]] > 1] for items in held]
            digests = {i: digests[i] if i in digests else checksums.of(i) for i in alike[coord.rank]}
            hashes = coord.all_gather(digests, "planning a save") if any(alike) else [{}] * coord.world
        offers = [  # an array hashed by no rank is one of a kind: its rank writes it
            [Offer(path, key + hashes[rank].get(i, f" of rank {rank}"), nbytes)
             for i, (path, key, nbytes) in enumerate(items)]
            for rank, items in enumerate(held)
        ]  # fmt: skip
        plan = assign(offers)
        skipped = [sum(n for *_, n in items) - plan.bytes_per_rank[r] for r, items in enumerate(held)]
        self.first = max(skipped) >= PLAN_FIRST_FROM  # ranks copying much they do not write: plan first
        self._described, self._alike = held, alike
        found: Listing = outcome[1]
        writes = plan.writes(coord.rank)
        return StepPlan(found.committed, found.attempt, plan, writes, checksums.kept(digests))


class _Checksums:
    """The checksums of a rank's arrays hashed to plan: the xxh3 that the ranks compare and, for a
    shard, its chunk checksums too (which its raw payload's entry lists: its bytes hashed once)."""

    def __init__(self, leaves: list[ArrayLeaf], bytes_of: Callable[[int], np.ndarray[Any, Any]]) -> None:
        self._leaves, self._bytes_of = leaves, bytes_of
        self._chunks: dict[int, Chunks] = {}

    def of(self, i: int) -> str:
        """The xxh3 of array ``i`` (of a shard: its chunks' combined, as its entry's checksum)."""
        data = self._bytes_of(i).reshape(-1).view(np.uint8).data
        if self._leaves[i].shard is None:
            return xxhash.xxh3_64_hexdigest(data)
        self._chunks[i] = chunks = hash_chunks(data, CHUNK_BYTES)
        return chunks.combined()

    def kept(self, digests: dict[int, str]) -> dict[int, str | Chunks]:
        """``digests`` with each shard's chunk checksums in place of its xxh3."""
        return {i: self._chunks.get(i, digest) for i, digest in digests.items()}


def save_step(
    replicas: ReplicaPlanner,
    store: Store,
    planner: SavePlanner,
    step: int,
    planned: Listing,
    tree: dict[str, Any],
    leaves: list[ArrayLeaf],
    arrays: Iterable[Staged],
    metrics: dict[str, Any],
    info: dict[str, Any],
    existing: Callable[[int], None],
) -> tuple[Manifest, frozenset[int]]:
    """Save this rank's part of ``step`` and commit the whole with the other ranks; return the
    committed manifest (the same on every rank) and the steps committed before it. ``arrays``: the
    snapshot of the arrays the rank writes, in ``planned.writes`` order, or of every array for
    :data:`PLAN_LATER` (the plan is made here, from the copies, which are read one by one as the
    writer takes them where it writes them all in order; ``existing(step)`` then deletes a
    committed but damaged ``step``, or refuses to save it again, as the save call does for a plan
    made there)."""
    coord = replicas.coord
    if not isinstance(planned, StepPlan):
        copies = _Copies(arrays)
        planned = replicas.plan(leaves, copies.get, store)
        arrays = copies.of(planned.writes, len(leaves))
        if step in planned.committed:
            existing(step)
    committed = planned.committed - {step}  # a damaged step saved again was deleted first
    writer, entries, marks, problem = _write_part(
        coord, store, planner, step, committed, leaves, arrays, planned
    )
    sent = {i: e.to_json() for i, e in entries.items()} if coord.shared else entries  # one process: as is
    reports = coord.all_gather(
        (problem, sent, tree, writer.files() if writer else {}, step, marks), f"committing step {step}"
    )

    def commit() -> Manifest:
        failed = [f"rank {r}: {report[0]}" for r, report in enumerate(reports) if report[0] is not None]
        if len({report[4] for report in reports}) > 1:  # each rank's part went to its own step
            saved = ", ".join(f"rank {r}: {report[4]}" for r, report in enumerate(reports))
            failed.append(f"the ranks saved different steps ({saved}); every rank must save the same step")
        if failed:
            raise CoordinationError(
                f"step {step} was not committed: " + "; ".join(failed) + ". Committed checkpoints are intact"
            )
        assert writer is not None
        manifest = _global_manifest(step, reports, planned.plan.writer, metrics, info, planner)
        writer.commit(manifest)
        return manifest

    try:
        outcome = coord.agree(commit, f"committing step {step}")
    except BaseException:
        planner.reset()
        if writer is not None and coord.leader:
            writer.abort()
        elif writer is not None:  # never delete a part the leader may be committing right now
            writer.close()
        raise
    if writer is not None and not coord.leader:
        writer.close()
    planner.committed(outcome, coord.rank if coord.shared else None)
    return outcome, planned.committed


class _Copies:
    """A snapshot's arrays, made a list only if the plan reads their bytes or leaves some out."""

    def __init__(self, arrays: Iterable[Staged]) -> None:
        self._arrays = arrays
        self._list: list[Staged] | None = None

    def get(self, i: int) -> np.ndarray[Any, Any]:
        if self._list is None:
            self._list = list(self._arrays)
        found = self._list[i]
        return found.array if isinstance(found, Unchanged) else found  # the committed bytes it equals

    def of(self, writes: list[int], count: int) -> Iterable[Staged]:
        """The arrays at ``writes``, of ``count`` arrays in all."""
        if self._list is None and writes == list(range(count)):
            return self._arrays  # every array, in order: the writer takes each as its copy lands
        if self._list is None:
            self._list = list(self._arrays)
        return [self._list[i] for i in writes]


def _write_part(
    coord: Coordination,
    store: Store,
    planner: SavePlanner,
    step: int,
    committed: frozenset[int],
    leaves: list[ArrayLeaf],
    arrays: Iterable[Staged],
    planned: StepPlan,
) -> tuple[StepWriter | None, dict[int, PayloadEntry], dict[str, float], str | None]:
    """Write the arrays the plan gives this rank, referring to the committed bytes of those proven
    unchanged (with the marks of the steps referred to); a failure is returned, not raised, so that
    the other ranks hear of it at the next exchange instead of waiting for this one (one process
    raises it as it is, after dropping its draft)."""
    writer = None
    entries: dict[int, PayloadEntry] = {}
    marks: dict[str, float] = {}
    failure: BaseException
    try:
        if coord.shared:
            writer = StepWriter(store, step, attempt=planned.attempt, part=f"r{coord.rank}")
        else:  # one process writes the step whole
            writer = StepWriter(store, step)
        rank = coord.rank if coord.shared else None
        if rank is None and any(leaf.shard is not None for leaf in leaves):
            rank = 0  # a rank's own shards as one process's step (a memory part): rank 0 of 1 wrote them
        for i, staged in zip(planned.writes, arrays, strict=True):
            leaf = leaves[i]
            if isinstance(staged, Unchanged):
                entry = _reference(staged, leaf, committed, rank)
                if entry is not None:
                    entries[i] = entry
                    marks[base_mark(staged.holding.step)] = staged.holding.created
                    planner.referenced(leaf.path)
                    continue
            array = staged.array if isinstance(staged, Unchanged) else staged
            encoded = planner.encode(leaf, array, step, committed)
            raw = encoded.codec.codec_id == "raw"
            hashed = planned.digests.get(i) if raw else None  # the same bytes
            chunk = CHUNK_BYTES if raw and leaf.shard is not None else None
            put = writer.write_payload(encoded.payload, hashed, chunk)
            config = encoded.codec.get_config()
            shard = None if leaf.shard is None else (leaf.shard.global_shape, leaf.shard.offset)
            entries[i] = PayloadEntry(
                leaf.path, leaf.kind, leaf.dtype, leaf.shape, put.file, put.offset, put.nbytes, put.xxh3,
                config, encoded.base, rank, shard, put.chunks,
            )  # fmt: skip
        if coord.shared:  # durable before rank 0 commits it (one process: its commit makes it so)
            writer.persist()
    except (CrashsafeError, OSError) as exc:
        if coord.shared:
            return writer, entries, marks, str(exc)
        failure = exc
    except BaseException as exc:
        failure = exc
    else:
        return writer, entries, marks, None
    if writer is not None:  # one process (or a failure no rank could report): nobody to tell, raised as it is
        writer.abort()
    planner.reset()  # references were advanced in place for a step that never committed
    raise failure


def _reference(
    unchanged: Unchanged, leaf: ArrayLeaf, committed: frozenset[int], rank: int | None
) -> PayloadEntry | None:
    """The entry referring to the committed bytes an unchanged array equals, if they are still
    there and hold this very part (this rank's, of this shard), else None: its bytes are written."""
    entry = unchanged.reference(committed, rank)
    shard = None if leaf.shard is None else (leaf.shard.global_shape, leaf.shard.offset)
    if entry is None or (entry.kind, entry.dtype, entry.shape, entry.shard) != (
        leaf.kind, leaf.dtype, leaf.shape, shard
    ):  # fmt: skip
        return None
    return entry


def _global_manifest(
    step: int,
    reports: list[Any],
    writer_of: dict[tuple[int, int], tuple[int, int]],
    metrics: dict[str, Any],
    info: dict[str, Any],
    planner: SavePlanner,
) -> Manifest:
    """Every rank's payloads in one table, and every rank's tree pointing into it; ``info`` gets
    the marks of the delta bases of every rank's payloads (every rank committed the same steps)."""
    payloads: list[PayloadEntry] = []
    index: dict[tuple[int, int], int] = {}
    files: dict[str, int] = {}
    marks: dict[str, float] = {}
    for rank, (_, entries, _, rank_files, _, rank_marks) in enumerate(reports):
        marks.update(rank_marks)
        files.update(rank_files)
        for i, body in sorted(entries.items()):
            index[rank, i] = len(payloads)
            payloads.append(body if isinstance(body, PayloadEntry) else _entry(body))
    if len(reports) == 1 and all(index.get(k) == k[1] and writer_of[k] == k for k in writer_of):  # as it is
        trees = [report[2] for report in reports]
    else:
        trees = [_renumbered(report[2], rank, index, writer_of) for rank, report in enumerate(reports)]
    info = {**info, **planner.base_marks(p.base for p in payloads if p.base is not None), **marks}
    return Manifest(step, time.time(), trees[0], tuple(payloads), files, metrics, info, tuple(trees[1:]))


def _entry(body: dict[str, Any]) -> PayloadEntry:
    shard, chunks = body.get("shard"), body.get("chunks")
    return PayloadEntry(
        body["path"], body["kind"], body["dtype"], tuple(body["shape"]), body["file"], body["offset"],
        body["nbytes"], body["xxh3"], body["codec"], body.get("base"), body.get("rank"),
        None if shard is None else (tuple(shard["global"]), tuple(shard["offset"])),
        None if chunks is None else Chunks(chunks["bytes"], tuple(chunks["xxh3"])), body.get("ref"),
    )  # fmt: skip


def _renumbered(
    node: Any, rank: int, index: dict[tuple[int, int], int], writer_of: dict[tuple[int, int], tuple[int, int]]
) -> Any:
    """A copy of ``rank``'s state tree whose array nodes point at the global payload table: its
    array ``i`` is the payload its writer wrote for it."""
    if isinstance(node, dict):
        if node.get("t") in ARRAY_NODES:  # an array, or a view into one
            return {**node, "id": index[writer_of[rank, node["id"]]]}
        return {k: _renumbered(v, rank, index, writer_of) for k, v in node.items()}
    if isinstance(node, list):
        return [_renumbered(v, rank, index, writer_of) for v in node]
    return node
