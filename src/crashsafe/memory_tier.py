"""The memory tier (docs/memory.md): every save goes first to a per-host memory directory (a RAM
disk such as ``/dev/shm/run``), in the same format and with the same commit protocol as any step,
so a killed process's memory copy survives it and is verified when read; only every Nth save also
goes to the persistent tier (the manager's ``directory``).

Each process writes its own part of a step there as a complete single-process step of its own
state, in ``<memory>/rank_<r>``. In a distributed job each part is then copied to ``copies - 1``
other ranks on other hosts (:func:`crashsafe.distributed.peers.placement`), which commit it in
their host's ``<memory>/rank_<r>``: a step is *complete* in the memory tier once every part has
its copies. Retention keeps each store's newest steps and never the newest complete one.
Recovery is :mod:`crashsafe.recovery`.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crashsafe._log import logger, warn
from crashsafe.catalog import Catalog
from crashsafe.distributed.group import SOLO, Coordination, Coordinator
from crashsafe.distributed.peers import Transfer, exchange, placement
from crashsafe.distributed.saving import PLAN_LATER, ReplicaPlanner, Staged, save_step
from crashsafe.encoding import SavePlanner
from crashsafe.errors import CrashsafeError, CrashsafeWarning, InvalidArgumentError, StorageError
from crashsafe.format.manifest import PART_KEY, Manifest
from crashsafe.policies.keep import KeepLast
from crashsafe.state.tree import ArrayLeaf
from crashsafe.state.unchanged import Unchanged
from crashsafe.storage.base import Lock, Store
from crashsafe.storage.local import LocalStore
from crashsafe.storage.localdir import LocalDir, UnsafeEntryError
from crashsafe.storage.reader import read_manifest
from crashsafe.storage.writer import delete_steps

__all__ = ["PART_KEY", "TIMELINE_KEY", "MemoryParts", "MemoryTier", "memory_tier"]

SAVES_KEY = "memory.saves"  # info of a memory part: the run's saves so far (every Nth persists)
TIMELINE_KEY = "memory.timeline"  # info of a memory part: the timeline that saved it (see MemoryParts)


@dataclass(frozen=True)
class MemoryTier:
    """A memory tier's settings.

    Args:
        path: this host's memory directory (a RAM disk: ``/dev/shm/<run>``); every process of the
            host writes its part in ``path/rank_<r>``.
        persist_every: every Nth save also goes to the persistent tier (and a save on SIGTERM).
        copies: copies of each part in the memory tier, the process's own included: a distributed
            job sends ``copies - 1`` to ranks on other hosts (at most one per host).
        keep_last: steps each memory store keeps (the newest complete step is always kept).
        host: this process's host, for placing copies (default: the host name); tests pretend.
    """

    path: str | os.PathLike[str]
    persist_every: int = 10
    copies: int = 2
    keep_last: int = 2
    host: str | None = None

    def __post_init__(self) -> None:
        for name in ("persist_every", "copies", "keep_last"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"MemoryTier({name}={value!r}): give a whole number of at least 1")


def memory_tier(spec: str | os.PathLike[str] | MemoryTier | None) -> MemoryTier | None:
    """The settings a manager's ``memory=`` gives: a path (defaults for the rest) or a MemoryTier."""
    if spec is None or isinstance(spec, MemoryTier):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        return MemoryTier(spec)
    raise InvalidArgumentError(f"memory= takes a directory or a MemoryTier, not a {type(spec).__name__}")


class MemoryParts:
    """One process's stores in the memory tier (its own part's first, then the copies it holds of
    other ranks' parts), how it saves its part, copies it to its peers and applies retention."""

    def __init__(self, tier: MemoryTier, coord: Coordination) -> None:
        self.tier, self.coord = tier, coord
        host = tier.host or socket.gethostname()
        named = coord.all_gather((host, _token()), "naming the hosts of the memory tier")
        hosts = [host for host, _ in named]
        self.timeline: str = named[0][1]  # rank 0's: new at each start and each restore
        copies = min(tier.copies, len(set(hosts)))
        if copies < tier.copies and coord.world > 1 and coord.leader:
            warn(
                f"the memory tier keeps {copies} cop{'y' if copies == 1 else 'ies'} of each part, not "
                f"{tier.copies}: the job runs on {len(set(hosts))} host(s), and copies go to other hosts. "
                "Name the hosts (MemoryTier(host=...)) if the host names do not tell them apart",
                CrashsafeWarning,
            )
        self.placement = placement(hosts, copies)
        rank = coord.rank
        self.held = [rank] + [o for o in range(coord.world) if o != rank and rank in self.placement[o]]
        self.stores: dict[int, Store] = {}
        self._locks: list[Lock] = []
        self._catalogs: dict[int, Catalog] = {}
        self.peers: Coordinator | None = None
        try:
            self._open(Path(tier.path))
            if isinstance(coord, Coordinator) and copies > 1:
                self.peers = Coordinator(coord.group, coord.timeout)  # copies travel beside the saves
        except BaseException:
            self.close()
            raise
        self._planner = SavePlanner(unchanged=False)  # raw, every byte owned: a part stands alone
        self._replicas = ReplicaPlanner(SOLO)
        self._saves = 0
        self.complete: int | None = None  # the newest step every part of which has its copies

    def _open(self, memory: Path) -> None:
        """Open, lock and clean the stores this rank holds; a store one rank refuses (a link, locked
        by another process) fails every rank alike, before the ranks make a group for the copies."""
        problem: CrashsafeError | None = None
        try:
            for owner in self.held:
                store = _part_store(memory, owner)
                self.stores[owner] = store
                self._locks.append(store.lock())
                store.remove_leftovers(store.leftovers())
                self._catalogs[owner] = Catalog(store)
        except CrashsafeError as exc:
            problem = exc
        said = self.coord.all_gather(None if problem is None else str(problem), "opening the memory tier")
        if problem is not None:
            raise problem
        failed = "; ".join(f"rank {r}: {p}" for r, p in enumerate(said) if p is not None)
        if failed:
            raise StorageError(f"opening the memory tier failed on another rank ({failed})")

    @property
    def own(self) -> Store:
        return self.stores[self.coord.rank]

    def due(self) -> bool:
        """Count a save; whether it also goes to the persistent tier (every ``persist_every``th)."""
        self._saves += 1
        return self._saves % self.tier.persist_every == 0

    def save(
        self, step: int, tree: dict[str, Any], leaves: list[ArrayLeaf], arrays: list[Staged],
        metrics: dict[str, Any], info: dict[str, Any], persist: bool,
    ) -> tuple[Manifest, bool]:  # fmt: skip
        """Commit this process's part of ``step`` in its memory store (an older save of that step
        number is replaced), send its copies to the peers, then apply retention. The ranks hear
        each other first: a part one rank could not commit fails every rank's save, and the step
        goes to the persistent tier too if any rank's ``persist`` says so (every ``persist_every``th
        save, or a SIGTERM heard: ranks hear it apart); the manifest, and whether it does."""
        own = self.own
        part = {
            **info, PART_KEY: f"{self.coord.rank}/{self.coord.world}", SAVES_KEY: self._saves,
            TIMELINE_KEY: self.timeline,
        }  # fmt: skip
        problem: Exception | None = None
        try:
            manifest, _ = save_step(
                self._replicas, own, self._planner, step, PLAN_LATER, tree, leaves, arrays, metrics, part,
                lambda again: delete_steps(own, [again]),
            )  # fmt: skip
        except Exception as exc:  # (every rank must hear of it, or the others wait for its copies)
            problem = exc
        told = (None if problem is None else str(problem), persist)
        said = self.coord.all_gather(told, f"saving step {step} in the memory tier")
        if problem is not None:
            raise problem
        failed = "; ".join(f"rank {r}: {p}" for r, (p, _) in enumerate(said) if p is not None)
        if failed:
            raise StorageError(
                f"step {step} could not be saved in the memory tier by a rank ({failed}). The steps "
                "committed are intact: fix that rank's memory directory and restart the job"
            )
        self._catalogs[self.coord.rank].forget([step])
        self._catalogs[self.coord.rank].committed(manifest)
        self.replicate(step, manifest, arrays)
        self.retain()
        return manifest, any(wanted for _, wanted in said)

    def replicate(self, step: int, manifest: Manifest, arrays: list[Staged]) -> None:
        """Copy every rank's part of ``step`` to its peers (every rank calls it): this rank's from the
        ``arrays`` its ``manifest`` was committed from, still staged (not read again); ``complete`` is
        ``step`` once every copy is committed and checked, else the problems are logged and warned."""
        if self.peers is None:
            self.complete = step
            return
        transfers = [
            Transfer(owner, step, owner, holder)
            for owner, holders in enumerate(self.placement)
            for holder in holders[1:]
        ]
        staged = [a.array if isinstance(a, Unchanged) else a for a in arrays]  # (none: unchanged=False)
        outcome = exchange(self.peers.group, self.coord.rank, transfers, self.stores.__getitem__,
                           f"copying step {step} to the peers", lambda t: (manifest, staged))  # fmt: skip
        mine = [f"{t.owner}->{t.target}: {problem}" for t, problem in outcome.items() if problem]
        problems = [
            p for rank_problems in self.peers.all_gather(mine, "copying a step") for p in rank_problems
        ]
        for transfer in transfers:
            if transfer.target == self.coord.rank and not outcome.get(transfer):
                self._catalogs[transfer.owner].forget([step])
        if problems:
            message = f"step {step} has fewer copies in the memory tier than asked: " + "; ".join(problems)
            warn(message, CrashsafeWarning)
            logger().warning("%s", message)
            return
        self.complete = step

    def retain(self) -> None:
        """Each memory store keeps its ``keep_last`` newest steps and the newest complete one."""
        keep = KeepLast(self.tier.keep_last)
        protect = set() if self.complete is None else {self.complete}
        for catalog in self._catalogs.values():
            try:
                catalog.retain(keep, protect)
            except CrashsafeError as exc:  # garbage, not a failed save: tried again at the next one
                logger().warning("memory tier retention in %s failed: %s", catalog.store.location, exc)

    def resumed_from(self, step: int | None) -> None:
        """The run resumed from the memory step ``step`` (None: a persistent one, itself a persisted
        save): saves are counted on from its count, so that every Nth save of the run persists
        however often it restarts; and retention keeps it until a newer step has all its copies."""
        self.timeline = self.coord.broadcast(_token(), "starting a timeline of the memory tier")
        saves = 0
        if step is not None:
            self.complete = step
            with contextlib.suppress(CrashsafeError, OSError):  # (read a moment ago: else from 0)
                saves = read_manifest(self.own, step).info.get(SAVES_KEY, 0)
        self._saves = saves if isinstance(saves, int) and not isinstance(saves, bool) and saves >= 0 else 0

    def drop_after(self, step: int | None) -> None:
        """Delete every memory step newer than ``step``, the one restored (None: every step): a run
        that resumed from ``step`` saves those numbers anew, and an older save of one of them must
        never be taken for a part of the new one."""
        for owner, store in self.stores.items():
            newer = [s for s in store.steps() if step is None or s > step]
            self._catalogs[owner].delete(newer)

    def close(self) -> None:
        with contextlib.ExitStack() as parts:
            for lock in self._locks:
                parts.callback(lock.release)
            for store in self.stores.values():
                parts.callback(store.close)
            if self.peers is not None:
                parts.callback(self.peers.close)


def _token() -> str:
    """A new timeline's name. Parts of one step number saved by different timelines (before and after
    a restore that went back, by a run before a restart) are never taken for one step."""
    return os.urandom(8).hex()


def _part_store(memory: Path, owner: int) -> Store:
    """The store of ``owner``'s part in this host's ``memory`` directory (created if missing),
    opened inside it without following a link: a ``rank_<r>`` that is a link or another file is
    refused (it would take the part's writes out of the memory tier: rule 11)."""
    name = f"rank_{owner}"
    try:
        memory.mkdir(parents=True, exist_ok=True)
        with LocalDir.open(memory) as parent:
            with contextlib.suppress(FileExistsError):
                parent.mkdir(name)
            return LocalStore.inside(parent, name, recycle=True)  # (a RAM disk: docs/memory.md)
    except UnsafeEntryError:
        raise StorageError(
            f"refusing the memory tier's {memory / name}: it is a link or another file, not a directory "
            "crashsafe made. Remove it (crashsafe recreates it) or choose another memory directory"
        ) from None
    except OSError as exc:
        raise StorageError(exc.errno, f"opening the memory tier's {memory / name}: {exc.strerror}") from None
