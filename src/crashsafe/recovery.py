"""Restore with a memory tier (docs/memory.md): the ranks agree on the newest step that they can
restore completely from memory, each rank from its own copy, else from a peer's copy pulled over
the group; only if no such step is read intact do they restore from the persistent tier, as
without a memory tier. Every rank restores the same step, and the decision is logged: which step,
from where, how long.

The persistent tier is not touched (not even listed) while the memory tier holds a complete step:
its steps are every Nth save of the same run, so the memory tier's newest complete step is at least
as new. Once a step is restored, the memory steps newer than it are deleted: the run saves those
numbers anew, and an older save must never pass for a part of a new one.
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from crashsafe._log import logger
from crashsafe.distributed.collective import Collective, PeerProblem
from crashsafe.distributed.peers import Transfer, exchange
from crashsafe.errors import CorruptCheckpointError, CrashsafeError, NoCheckpointError, StorageError
from crashsafe.loading import skip_damaged
from crashsafe.memory_tier import PART_KEY, TIMELINE_KEY, MemoryParts
from crashsafe.restoring import Changes, restore_into, restore_part
from crashsafe.storage.base import Store
from crashsafe.storage.reader import read_manifest
from crashsafe.storage.writer import delete_steps

__all__ = ["Recovery", "restore_tiers"]

ATTEMPTS = 3  # listings of the memory tier: a damaged copy is deleted and the step pulled again


@dataclass(frozen=True)
class Recovery:
    """How a restore went, on this rank: the ``step``, ``source`` ("memory": this rank's own copy,
    "peer <rank>": a copy pulled from that rank, "persistent": the persistent tier) and seconds."""

    step: int
    source: str
    seconds: float


def restore_tiers(
    stores: Sequence[Store],
    state: MutableMapping[str, Any],
    step: int | None,
    collective: Collective,
    memory: MemoryParts | None,
) -> tuple[int | None, Recovery | None]:
    """Restore ``step`` (None: the newest) into ``state``, from the memory tier if it holds it
    complete, else from the persistent ``stores``; the step restored (None: there was none) and how."""
    began, changes = time.perf_counter(), Changes()  # (a memory step damaged once it wrote: noted)
    skipped: list[str] = []  # why complete memory steps were not restored
    if memory is not None:
        recovered = _from_memory(memory, state, step, collective, began, changes, skipped)
        if recovered is not None:
            memory.resumed_from(recovered.step)  # (a collective: before anything one rank may fail at)
            memory.drop_after(recovered.step)
            return recovered.step, recovered
    found = restore_into(stores, state, step, collective, changes)
    if memory is None:
        return found, None
    if found is None and skipped:  # as a persistent tier all damaged: not "nothing saved, start afresh"
        raise CorruptCheckpointError(
            f"no step of the memory tier {memory.tier.path} could be restored ({'; '.join(skipped)}), and "
            f"{stores[0].location} holds no step. Run `crashsafe verify` on the memory directory for "
            "details; delete it to start afresh"
        )
    memory.resumed_from(None)
    memory.drop_after(found)
    if found is None:
        return None, None
    recovery = Recovery(found, "persistent", time.perf_counter() - began)
    logger().info("recovered step %d from the persistent tier in %.2f s", found, recovery.seconds)
    return found, recovery


_Save = tuple[int, str]  # a memory step: its number and the timeline that saved it


def _holdings(memory: MemoryParts) -> dict[int, list[tuple[int, str, float]]]:
    """The memory steps this rank holds of each part, by owner: (step, timeline, created), committed,
    with a manifest that names that very part of a job of this size (a store left by another job is
    not taken)."""
    found: dict[int, list[tuple[int, str, float]]] = {}
    for owner, store in memory.stores.items():
        for step in store.steps():
            try:
                manifest = read_manifest(store, step)
            except (CrashsafeError, OSError):
                continue  # damaged or gone: not a copy
            if manifest.info.get(PART_KEY) == f"{owner}/{memory.coord.world}":
                timeline = _timeline(manifest.info)
                found.setdefault(owner, []).append((step, timeline, manifest.created))
    return found


def _timeline(info: dict[str, Any]) -> str:
    timeline = info.get(TIMELINE_KEY)
    return timeline if isinstance(timeline, str) else ""


def _from_memory(
    memory: MemoryParts,
    state: MutableMapping[str, Any],
    asked: int | None,
    collective: Collective,
    began: float,
    changes: Changes,
    skipped: list[str],
) -> Recovery | None:
    coord = memory.coord
    for _ in range(ATTEMPTS):
        held = coord.all_gather(_holdings(memory), "listing the memory tier")
        holders: dict[_Save, dict[int, list[int]]] = {}  # save -> owner -> the ranks holding its copy
        created: dict[_Save, float] = {}
        for holder, holding in enumerate(held):
            for owner, steps in holding.items():
                for at, timeline, when in steps:
                    holders.setdefault((at, timeline), {}).setdefault(owner, []).append(holder)
                    created[at, timeline] = max(created.get((at, timeline), when), when)
        complete = [save for save, parts in holders.items() if len(parts) == coord.world]
        complete.sort(key=lambda save: (save[0], created[save], save[1]), reverse=True)  # the newest first
        retry = False
        for save in [s for s in complete if asked is None or s[0] == asked]:
            at = save[0]
            source = _pull(memory, at, holders[save], skipped)
            if source is None:
                continue
            outcome = _restore(memory, save, state, collective, changes, skipped)
            if outcome is None:
                recovery = Recovery(at, source, time.perf_counter() - began)
                logger().info(
                    "recovered step %d from the memory tier (%s) in %.2f s", at, source, recovery.seconds
                )
                return recovery
            if outcome == "retry":
                retry = True
                break
        if not retry:
            return None
    return None


def _pull(memory: MemoryParts, step: int, parts: dict[int, list[int]], skipped: list[str]) -> str | None:
    """Make sure every rank holds its own part of ``step``, pulling it from a peer's copy where its
    own is missing; where this rank's part came from, or None if a pull failed on any rank (why:
    in ``skipped``)."""
    coord, rank = memory.coord, memory.coord.rank
    pulls = [Transfer(owner, step, holders[0], owner) for owner, holders in sorted(parts.items())
             if owner not in holders]  # fmt: skip
    if not pulls:
        return "memory"
    if memory.peers is None:  # (no copies on peers: a part held elsewhere cannot be pulled)
        return None
    outcome = exchange(memory.peers.group, rank, pulls, memory.stores.__getitem__, f"pulling step {step}")
    mine = [
        f"rank {t.target} from rank {t.source}: {p}" for t, p in outcome.items() if p and t.target == rank
    ]
    problems = [p for found in coord.all_gather(mine, f"pulling step {step}") for p in found]
    if problems:
        message = f"step {step} of the memory tier could not be pulled from the peers: " + "; ".join(problems)
        skip_damaged(message + ". Trying an older step")
        logger().warning("%s", message)
        skipped.append(message)
        return None
    pulled = [t.source for t in pulls if t.owner == rank]
    return f"peer {pulled[0]}" if pulled else "memory"


def _restore(
    memory: MemoryParts, save: _Save, state: MutableMapping[str, Any], collective: Collective,
    changes: Changes, skipped: list[str],
) -> str | None:  # fmt: skip
    """Restore every rank's own part of ``step`` together: None once done; "retry" if a rank's own
    copy was damaged (deleted now, so the step is pulled again from a peer that holds one). Another
    error (a live state that does not fit) is raised on every rank, and nothing is deleted."""
    coord, step = memory.coord, save[0]
    kind, message, apply, error = "ok", "", None, None
    try:
        _check_label(memory, save, collective)
        apply = restore_part(memory.own, step, state, collective, changes)
    except PeerProblem:
        kind = "peer"
    except (CorruptCheckpointError, StorageError, NoCheckpointError) as exc:
        kind, message = "damaged", str(exc)
    except CrashsafeError as exc:  # (the live state does not fit it): every rank hears, and raises
        kind, message, error = "error", str(exc), exc
    outcomes = coord.all_gather((kind, message), f"restoring step {step} from the memory tier")
    if all(k == "ok" for k, _ in outcomes):
        assert apply is not None
        apply()
        return None
    if error is not None:
        raise error
    failed = "; ".join(f"rank {r}: {m}" for r, (k, m) in enumerate(outcomes) if k == "error")
    if failed:
        raise CrashsafeError(f"step {step} of the memory tier could not be restored by every rank: {failed}")
    bad = "; ".join(f"rank {r}: {m}" for r, (k, m) in enumerate(outcomes) if k == "damaged")
    skip_damaged(f"skipping step {step} of the memory tier ({bad})")
    logger().warning("fell back from step %d of the memory tier because %s", step, bad)
    skipped.append(f"step {step}: {bad}")
    if kind == "damaged":
        delete_steps(memory.own, [step])  # a peer's copy is pulled in its place, if one is intact
    return "retry"


def _check_label(memory: MemoryParts, save: _Save, collective: Collective) -> None:
    """Raise CorruptCheckpointError unless this rank's own copy of ``save`` is labelled its own part
    of that timeline (it may have been replaced or damaged since the listing, or be a peer's copy of
    another part), having told the other ranks as :func:`restore_part` would before writing."""
    (step, timeline), part = save, f"{memory.coord.rank}/{memory.coord.world}"
    try:
        info = read_manifest(memory.own, step).info
    except (CrashsafeError, OSError) as exc:
        problem = str(exc)
    else:
        if info.get(PART_KEY) == part and _timeline(info) == timeline:
            return
        problem = (
            f"its step {step} is labelled {PART_KEY}={info.get(PART_KEY)!r} of timeline "
            f"{_timeline(info)!r}, not {part!r} of {timeline!r}"
        )
    collective.before_writing(problem, step)  # (the others leave their restore_part in step)
    raise CorruptCheckpointError(problem)
