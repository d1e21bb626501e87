"""Restore into live objects, each payload read (or decoded) straight into its live tensor's memory.

A step is restored in three phases:

1. Everything that can be checked without writing into the live state is checked first: the
   manifest, the data files' sizes, that the saved state fits the live one (``check_into``); the
   payloads that cannot go into live memory (:mod:`crashsafe.state.inplace`) are read and verified
   into fresh memory.
2. Every other payload is read straight into its live tensor or array (raw), or decoded into it
   (zstd, delta chains, LC ...), verified chunk by chunk as it is read, several payloads at once.
   A live CUDA tensor's payload is read into pinned bounce buffers, each chunk checksummed as it
   lands and copied to the device while the next one is read (a payload to decode is decoded on
   the host, then copied once).
3. Modules, optimizers and containers take their values (``apply_into``), which are already there.

Safety: a payload found damaged in phase 2 has already changed live memory. Restore then falls
back to the next older step and restores it completely, so every tensor is written again and the
live state ends wholly in the older step, never half old and half damaged. A step with no step left
behind it to fall back to (the oldest one, or the step that ``step=`` names) is verified completely
before its first byte goes into live memory, so its damage leaves the live state unchanged.

A payload that refers to an earlier step's bytes (format version 4) is read from that step, as
its own payload, checked as every payload is. A step that a writer deletes while it is read counts
like damage here. Phase 1 opens every step the payloads' delta chains and references run through,
and a local step's open files stay readable after it is deleted, so a local step found in phase 1
is read to its end; one deleted before that vanishes before anything live is changed, and restore
tries the newest step listed afresh. (An object store's objects go with the step: a step deleted
in phase 2 there is fallen back from like damage.)

Two cases remain, and the error says the live state was changed and by which step: the newest step
is damaged (or deleted, on an object store) after it changed the live state, and every step
tried after it is damaged or deleted too, or the intact one restore falls back to does not fit the
live state (a key that step lacks).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from crashsafe._cuda import DeviceUpload, synchronize
from crashsafe.chain import ChainReader
from crashsafe.distributed.collective import Collective
from crashsafe.distributed.shards import Targets, box_jobs, fill_from, read_range
from crashsafe.distributed.trees import plain_tree
from crashsafe.errors import CrashsafeError, NoCheckpointError, UnsupportedStateError
from crashsafe.format.manifest import PayloadEntry
from crashsafe.loading import array_ids, first_intact, read_value, reading_error, state_of
from crashsafe.state.inplace import Destination, live_destinations
from crashsafe.state.rebuild import apply_into, check_into
from crashsafe.storage.base import Store

__all__ = ["Changes", "restore_into", "restore_part"]

# payloads read or decoded at once: on an H100 machine (16 cores) 8 lanes restored a cached 1.6 GB
# CUDA state in 0.66x the time of 4 (bench/results/gpu.md); here (2 cores) it is 2 either way
MAX_THREADS = 8
LANES_FROM = 32 << 20  # raw bytes from which a cached step is copied by a thread per core


_Work = Callable[[PayloadEntry, Destination], object]  # one payload: read into place, or check


class Changes:
    """Whether an attempt already wrote into the live state, and which one left it half written."""

    def __init__(self) -> None:
        self.made = False
        self.by = ""  # "step 7, which turned out damaged" (or "was deleted while it was read")


def restore_into(
    stores: Sequence[Store],
    state: MutableMapping[str, Any],
    step: int | None,
    collective: Collective,
    changes: Changes | None = None,
) -> int | None:
    """Restore ``step`` (None: the newest intact one, falling back past damaged ones) into the live
    ``state`` in place; return its step, or None if there is no step at all. The ranks of a
    distributed manager each restore their part, a live DTensor the saved shards that meet its box,
    and fall back together: the live objects take their values once every rank read intact.
    ``changes``: what an attempt before this one (the memory tier's) wrote into the live state."""
    changes = changes or Changes()
    targets, rank = collective.targets(state), collective.reader_rank

    def attempt(store: Store, candidate: int, last: bool) -> dict[str, Any]:
        verify_first = last and not changes.made
        agree = functools.partial(collective.before_writing, step=candidate)
        return restore_step(store, candidate, state, verify_first, changes, rank, targets, agree)

    try:
        found = first_intact(stores, step, attempt, collective.coord)
    except CrashsafeError as exc:
        if changes.made and isinstance(exc, UnsupportedStateError):
            exc.args = (
                f"{exc} The live state was partly overwritten by {changes.by}, and the intact step "
                "restore fell back to does not fit it: rebuild the live objects (model, optimizer) as "
                "that step was saved, then restore again.",
            )
        elif changes.made:
            exc.args = (f"{exc} {_half_written(changes)}",)
        raise
    if found is None:
        if changes.made:  # every step went while it was read, or damaged, after writing: not "no step"
            gone = "was deleted while it was read" if changes.by.endswith("read") else "is left to restore"
            raise NoCheckpointError(f"no step of {stores[0].location} {gone}. {_half_written(changes)}")
        return None
    apply_into(state, found[1])
    return found[0]


def restore_part(
    store: Store, step: int, state: MutableMapping[str, Any], collective: Collective, changes: Changes
) -> Callable[[], None]:
    """Phases 1 and 2 for this process's own single-process ``step`` of ``store`` (a memory-tier
    part), with no verifying pass first: a damaged payload raises once live memory may be changed,
    and the caller falls back to another step, restored completely. Returns phase 3, to run once
    every rank read its part intact. ``changes`` notes whether it wrote into the live state."""
    agree = functools.partial(collective.before_writing, step=step)
    saved = restore_step(store, step, state, False, changes, None, collective.targets(state), agree)
    return functools.partial(apply_into, state, saved)


def _half_written(changes: Changes) -> str:
    """What the error of a restore that changed the live state and then failed adds to it."""
    told = f"The live state was partly overwritten by {changes.by}, and no"
    if changes.by.endswith("deleted while it was read"):
        return f"{told} step was left to restore completely: restore again, or rebuild the live objects."
    return (
        f"{told} intact step was left to restore completely: rebuild the live objects (model, optimizer) "
        "before you train from scratch."
    )


def restore_step(
    store: Store,
    step: int,
    state: MutableMapping[str, Any],
    verify_first: bool,
    changes: Changes,
    rank: int | None = None,
    targets: Targets | None = None,
    agree: Callable[[str | None], None] | None = None,
) -> dict[str, Any]:
    """Phases 1 and 2 of the module doc for ``rank``'s part of one step; return the saved state
    for ``apply_into`` (phase 3), its arrays already in the live memory they go to. ``agree`` (the
    ranks of a distributed manager) hears this rank's problem with phase 1, or None, and raises if
    another rank has one: no rank writes into its live state unless every rank's part can go in."""
    try:
        with ChainReader(store) as chains:
            try:
                saved, jobs, cached = _prepare(chains, step, state, verify_first, rank, targets)
            except (CrashsafeError, OSError) as exc:
                if agree is not None:
                    agree(str(exc))
                raise
            if agree is not None:
                agree(None)
            if jobs:  # (a fallback after this from here on: damage, here or on another rank)
                changes.made, changes.by = True, f"step {step}, which turned out damaged"
            synchronize([d.device for _, d in jobs if d.device is not None])  # no kernel still uses them
            try:
                _each(jobs, lambda entry, d: _decode_into(chains, step, entry, d), cached)
            except NoCheckpointError:
                changes.by = f"step {step}, which was deleted while it was read"
                raise
    except OSError as exc:
        raise reading_error(exc, store, step) from None
    return saved


def _prepare(
    chains: ChainReader,
    step: int,
    state: MutableMapping[str, Any],
    verify_first: bool,
    rank: int | None,
    targets: Targets | None,
) -> tuple[dict[str, Any], list[tuple[PayloadEntry, Destination]], bool]:
    """Phase 1: the saved state (checked against the live one), the payloads to read into live
    memory, and whether the step is in the page cache; with ``verify_first`` those are verified."""
    manifest = chains.manifest(step)
    tree = plain_tree(manifest) if rank is None else manifest.tree_of(rank)
    into = live_destinations(state, tree, manifest.payloads)
    values: list[Any] = [None] * len(manifest.payloads)
    for i in sorted(array_ids(tree)):
        found = into.get(i)
        entry = manifest.payloads[i]
        values[i] = found.value if found else read_value(chains, manifest, entry, False, targets)
    saved = state_of(tree, values, step)
    check_into(state, saved)  # a mismatch raises before anything live is changed
    jobs = []
    for i, d in into.items():  # a shard: each saved shard of its array that meets the box
        entry = manifest.payloads[i]
        jobs += [(entry, d)] if d.box is None else box_jobs(manifest, entry, d)
    chains.open_chains(step, [entry for entry, _ in jobs])  # nothing can vanish from here on (local)
    # probed where the largest read starts (a rank may read only a part of a shard)
    largest = max((job for job in jobs if _is_raw(job[0])), key=_length, default=None)
    cached = largest is not None and chains.cached(step, largest[0], *_span(largest))
    if verify_first:
        _each(jobs, lambda entry, d: _check(chains, step, entry, d), cached)
    return saved, jobs, cached


def _decode_into(chains: ChainReader, step: int, entry: PayloadEntry, into: Destination) -> None:
    if into.device is not None:
        upload = DeviceUpload(into.device)
        try:
            chains.decode(step, entry, upload=upload)
        finally:
            upload.finish()  # nothing lands in live memory after this returns, or after damage
    elif into.box is None:
        chains.decode(step, entry, out=into.out)
    else:
        fill_from(chains, step, entry, into)


def _check(chains: ChainReader, step: int, entry: PayloadEntry, into: Destination) -> None:
    """Verify what :func:`_decode_into` will read (of a shard that only overlaps the live box:
    the chunks holding its part), writing nothing."""
    if into.box is None:
        chains.check(step, entry)
    else:
        fill_from(chains, step, entry, into, verify_only=True)


def _each(jobs: list[tuple[PayloadEntry, Destination]], work: _Work, cached: bool) -> None:
    """``work`` on every job. Raw payloads of a ``cached`` step (in the page cache) go in a lane
    per core of about equal bytes, from LANES_FROM bytes on; from the disk in one lane, one
    sequential stream being what the disk serves best here; each lane in file order. Payloads to
    decode are spread over the cores beside them, the largest first; payloads of delta chains go
    last, one at a time (a chain opens readers of other steps). Returns once no job runs any more,
    so nothing writes into live memory after a failure is raised."""
    cores = min(MAX_THREADS, os.cpu_count() or 1)
    raw = [j for j in jobs if _is_raw(j[0])]
    lanes = _lanes(raw, cores if cached and sum(map(_length, raw)) >= LANES_FROM else 1)
    decode = sorted((j for j in jobs if not _is_raw(j[0]) and j[0].base is None), key=lambda j: -j[0].nbytes)
    lanes += [[job] for job in decode]
    threads = min(cores, len(lanes))
    if threads <= 1:  # here: no thread to start
        _run([job for lane in lanes for job in lane], work)
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="crashsafe-read") as pool:
            futures = [pool.submit(_run, lane, work) for lane in lanes]
            try:
                for future in futures:
                    future.result()
            finally:
                for future in futures:
                    future.cancel()
                wait(futures)
    _run([j for j in jobs if not _is_raw(j[0]) and j[0].base is not None], work)


def _lanes(
    raw: list[tuple[PayloadEntry, Destination]], count: int
) -> list[list[tuple[PayloadEntry, Destination]]]:
    """Raw payloads dealt into ``count`` lanes of about equal bytes read, each read in file order."""
    lanes: list[list[tuple[PayloadEntry, Destination]]] = [[] for _ in range(count)]
    loads = [0] * count
    for job in sorted(raw, key=lambda j: -_length(j)):
        lightest = loads.index(min(loads))
        lanes[lightest].append(job)
        loads[lightest] += _length(job)
    return [sorted(lane, key=lambda j: (j[0].file, j[0].offset)) for lane in lanes if lane]


def _run(lane: list[tuple[PayloadEntry, Destination]], work: _Work) -> None:
    for entry, destination in lane:
        work(entry, destination)


def _span(job: tuple[PayloadEntry, Destination]) -> tuple[int, int]:
    """The bytes of a job's payload that it reads (a part of a shard with chunk checksums)."""
    entry, into = job
    return (0, entry.nbytes) if into.box is None else read_range(entry, into)


def _length(job: tuple[PayloadEntry, Destination]) -> int:
    """How many bytes of its payload a job reads (before rounding out to whole chunks)."""
    start, stop = _span(job)
    return stop - start


def _is_raw(entry: PayloadEntry) -> bool:
    return entry.codec == {"id": "raw"} and entry.nbytes == entry.raw_nbytes
