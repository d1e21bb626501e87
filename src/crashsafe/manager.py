"""CheckpointManager: policy -> snapshot -> encode -> persist -> commit -> retention, and restore.

The training loop waits only for the snapshot (a copy into reusable staging buffers); encoding,
writing, fsync, the atomic commit and retention run in one background thread. At most one save
is in flight: a new save first waits for the previous one, whose error (if any) it raises.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

from crashsafe._log import warn
from crashsafe._metrics import clean_metrics
from crashsafe._runtime import forked, refuse_forked
from crashsafe.distributed.collective import collective_for
from crashsafe.distributed.group import DEFAULT_TIMEOUT
from crashsafe.distributed.saving import Listing, save_step
from crashsafe.encoding import CodecSpec, SavePlanner
from crashsafe.errors import (
    CorruptCheckpointWarning,
    CrashsafeError,
    InvalidArgumentError,
    NoCheckpointError,
    UnsupportedStateError,
)
from crashsafe.format.manifest import Manifest, checked_step
from crashsafe.loading import check_device, listed_steps, manifest_of, note_read, on_damage, read_step
from crashsafe.mapping import map_step
from crashsafe.memory_tier import MemoryParts, MemoryTier, memory_tier
from crashsafe.pacing import Pacing
from crashsafe.pending import PendingSave
from crashsafe.policies.base import EverySteps, SaveContext, SavePolicy
from crashsafe.policies.keep import KeepPolicy, Mode
from crashsafe.policies.retention import UNSET, KeepSpec, Unset, retention_policy
from crashsafe.preemption import EXIT_STATUS, SigtermWatch
from crashsafe.recovery import Recovery, restore_tiers
from crashsafe.saving import SaveStats, Snapshot, take_snapshot
from crashsafe.state.staging import StagingPool
from crashsafe.step_facts import StepSpec, best_step, pick_step
from crashsafe.storage.base import Store
from crashsafe.tiers import Tiers

__all__ = ["CheckpointManager", "CodecSpec", "SaveStats"]

_T = TypeVar("_T")

_VERSION = "0.1.0"


class CheckpointManager:
    """Saves and restores training state in ``directory``, one ``step_<n>`` per committed step.

    Args:
        directory: where checkpoints live: a local directory (created if missing), or an fsspec
            URL such as ``s3://bucket/run`` (see docs/storage.md).
        keep: a keep policy, e.g. ``KeepLast(5) | KeepBest(3, "val_loss")`` (docs/policies.md); the
            newest step is always kept. Or the shorthands ``keep_last`` (default 3; None keeps all)
            and ``keep_every``: ``KeepLast(keep_last) | KeepEvery(keep_every)``.
        async_save: persist in a background thread after a memcpy snapshot.
        codec: one codec (``"raw"``, ``"zstd"``, a Codec) or ``{glob: codec}`` by state path, most
            specific pattern first. Lossy codecs (``LC``, ``Scar``, ``TopN``) only take float
            tensors; other leaves fall through to the next matching pattern, else ``raw``. Delta
            codecs (``Incremental``, ``LC``, ...) encode against the previous save of the same
            path, which the manager keeps in memory; the first save after start is a full one.
        lossless: glob patterns of state paths that never get a lossy codec.
        policy: decides ``maybe_save``; default saves at every call.
        read_only: open for reading only (no lock; save is refused).
        save_on_sigterm: on SIGTERM, the next ``save``/``maybe_save`` commits, then exits (143).
        storage_options: for a URL (``directory`` or ``mirror``), passed to fsspec as they are (key,
            secret, ``client_kwargs={"endpoint_url": ...}``).
        mirror: a second tier, usually ``s3://bucket/run``: each step committed locally is copied
            there in the background, verified after upload; ``restore`` takes the newest intact
            step of either tier, so a new machine with an empty ``directory`` resumes from it.
        mirror_keep, mirror_keep_last, mirror_keep_every: the mirror's retention (default: keep all).
        process_group: with torch.distributed initialized (or this group given) the manager is
            collective: every rank constructs it and calls save/restore/load/steps alike; each rank
            writes its part and rank 0 commits the step for all (docs/distributed.md).
        coordination_timeout: seconds a rank waits for the others at each exchange before it
            raises CoordinationError (a rank died or hangs), never hanging.
        pinned_bytes: cap on the pinned host memory staging CUDA tensors (docs/gpu.md).
        unchanged: False copies and writes every tensor, even one proven unchanged (docs/unchanged.md).
        memory: a memory tier (docs/memory.md): a RAM-disk directory, or a :class:`MemoryTier`; every
            save goes there, every ``persist_every``th also to ``directory``; ranks copy it to peers.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: KeepSpec = None,
        keep_last: int | Unset | None = UNSET,
        keep_every: int | None = None,
        async_save: bool = True,
        codec: CodecSpec = None,
        lossless: Sequence[str] = (),
        policy: SavePolicy | None = None,
        read_only: bool = False,
        save_on_sigterm: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        mirror: str | os.PathLike[str] | None = None,
        mirror_keep: KeepSpec = None,
        mirror_keep_last: int | Unset | None = UNSET,
        mirror_keep_every: int | None = None,
        process_group: Any = None,
        coordination_timeout: float = DEFAULT_TIMEOUT,
        pinned_bytes: int | None = None,
        unchanged: bool = True,
        memory: str | os.PathLike[str] | MemoryTier | None = None,
    ) -> None:
        self.directory = os.fspath(directory)
        self.mirror = None if mirror is None else os.fspath(mirror)
        self._tiers = Tiers(
            self.directory,
            self.mirror,
            retention_policy(keep, keep_last, keep_every, default_last=3),  # None: keep every step
            retention_policy(mirror_keep, mirror_keep_last, mirror_keep_every, "mirror_"),
            storage_options or {},
        )
        self.async_save = async_save
        self.read_only = read_only
        self.policy: SavePolicy = policy if policy is not None else EverySteps(1)
        tier = memory_tier(memory)
        if tier is not None and read_only:
            raise InvalidArgumentError(
                f"memory= with read_only=True: a read-only manager reads {self.directory} only, an older "
                "step than the memory tier holds. Drop memory= to read the persistent tier, or open "
                "without read_only to restore from the memory tier"
            )
        self._planner = SavePlanner(codec, lossless, unchanged=unchanged and tier is None)
        self._listed: set[int] | None = None  # the steps the last background save listed, and it
        self._pool = StagingPool(pinned_bytes) if async_save else None
        self._pending = PendingSave(background=async_save)
        self._pacing = Pacing()
        self._sigterm = SigtermWatch(False)
        self._closed = False
        self._pid = os.getpid()  # a forked child may read with this manager: never write, wait or release
        self._collective = collective_for(process_group, coordination_timeout, self.mirror)
        self._memory: MemoryParts | None = None
        self.recovery: Recovery | None = None  # how the last restore went: which step, from where, how long
        if read_only:
            if self.mirror is None:
                self._tiers.open(self.directory, existing=True).close()  # it must exist
            return
        try:  # rank 0 (or one process) creates, locks and cleans; then the others open what it made
            self._sigterm = SigtermWatch(save_on_sigterm)  # refused off the main thread: before the lock
            self._collective.agree(lambda: self._tiers.open_writer(leader=True), f"opening {self.directory}")
            if not self._collective.leader:
                self._tiers.open_writer(leader=False)
            self._memory = MemoryParts(tier, self._collective.coord) if tier else None
        except BaseException:
            self.close()
            raise

    @property
    def keep(self) -> KeepPolicy | None:
        """The retention policy of the manager's own store (None: every step is kept)."""
        return self._tiers.keep

    # ----------------------------------------------------------------------------- saving

    def save(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None = None) -> None:
        """Checkpoint ``state`` as ``step``. Returns once the state is copied (async) or committed."""
        store = self._writable()
        step = checked_step(step)
        if not isinstance(state, Mapping):
            raise UnsupportedStateError(f"state must be a dict of named values, got a {type(state).__name__}")
        begin = time.perf_counter()
        self._wait_pending()
        self._tiers.before_save()
        self._tiers.check(f"saving step {step}")
        cleaned = clean_metrics(metrics)
        checked = bool(self._pending.stats)  # a save committed: the state's layout was checked in full
        if self._pool is not None:
            self._pool.begin_save()  # (what this save allocates, as one-time setup: SaveStats.setup)
        replicas, watch, memory = self._collective.replicas, self._planner.watch, self._memory
        persistent = memory is None or memory.due() or self._sigterm.arrived  # else a memory save only
        snapshot, planned = take_snapshot(state, store, self._pool, replicas, watch, checked, bool(memory))
        known = self._listed is None or step in self._listed  # else new: this writer holds the lock
        if persistent and self._collective.committed(store, step, planned, known):
            self._replace_damaged(step)
        stall = time.perf_counter() - begin
        setup = self._pool.setup if self._pool is not None else 0.0
        self._pacing.stalled(stall)
        self._pacing.saved(step)

        persist = functools.partial(
            self._persist, store, step, planned, snapshot, cleaned, (stall, setup), persistent
        )
        self._pacing.stalled(self._pending.start(step, persist, begin))  # sync: it waited for the commit too
        if self._sigterm.arrived:
            self._exit_after_preemption()

    def _replace_damaged(self, step: int) -> None:
        """Saving a committed step is refused, unless it is damaged (a run that fell back from it saves
        it again: deleted first, with a warning) and no intact step is a delta of it."""
        self._collective.agree(lambda: self._tiers.make_room(step), f"saving step {step}")
        message = f"step {step} was committed but damaged; it was deleted and is saved again"
        warn(message, CorruptCheckpointWarning)

    def maybe_save(
        self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None = None
    ) -> bool:
        """Save if the policy says so (or a SIGTERM arrived); return whether it saved. Distributed, rank
        0's policy decides for every rank (each rank's own clock would decide apart)."""
        if self._sigterm.arrived:
            if self._pacing.last_save is None or self._pacing.last_save[0] != step:
                self.save(step, state, metrics)
            self._exit_after_preemption()
        wanted = self.policy.should_save(self.context(step, metrics))
        if not self._collective.decide(wanted, step):
            return False
        self.save(step, state, metrics)
        return True

    def context(self, step: int, metrics: Mapping[str, Any] | None = None) -> SaveContext:
        """The facts a policy decides on, as measured by this manager."""
        if self._pending.done:
            self._wait_pending()  # a finished background save: its measured cost is visible now
        return self._pacing.context(step, metrics, self._pending.stats)

    def wait(self) -> None:
        """Block until every pending save is committed; raise its error if it failed."""
        self._wait_pending()

    def wait_mirror(self, timeout: float | None = None) -> bool:
        """Block until every committed step is in the mirror (or failed, for now: MirrorWarning)."""
        self._wait_pending()
        return self._tiers.wait_mirror(timeout)

    @property
    def stats(self) -> list[SaveStats]:
        """Costs of the saves this manager committed, oldest first."""
        return list(self._pending.stats)

    @property
    def preempted(self) -> bool:
        """True once SIGTERM arrived (with ``save_on_sigterm=True``)."""
        return self._sigterm.arrived

    def _persist(
        self, store: Store, step: int, planned: Listing, snapshot: Callable[[], Snapshot],
        metrics: dict[str, Any], stall: tuple[float, float], persistent: bool,
    ) -> SaveStats:  # fmt: skip
        """Write and commit a save (``planned``: what the ranks agreed, or PLAN_LATER): to the memory
        tier first if there is one, then (``persistent``) to the store; then retention. ``stall``:
        the save call's stall, and the part of it that allocated staging."""
        begin = time.perf_counter()
        info = {"crashsafe": _VERSION}
        tree, leaves, arrays = snapshot()
        if self._memory is not None:
            arrays = list(arrays)  # (staged: written twice on a persistent save)
            kept, persistent = self._memory.save(step, tree, leaves, arrays, metrics, info, persistent)
            if not persistent:
                taken = time.perf_counter() - begin
                return SaveStats(step, stall[0], taken, kept.raw_nbytes, kept.stored_nbytes, stall[1])
        manifest, listed = save_step(
            self._collective.replicas, store, self._planner, step, planned, tree, leaves, arrays,
            metrics, info, self._replace_damaged,
        )  # fmt: skip
        persisted = time.perf_counter() - begin  # committed, and every rank heard it; retention comes after
        self._listed = {*listed, step}
        self._tiers.committed(manifest)
        if self._collective.leader:
            self._tiers.retain_after(step)
        return SaveStats(step, stall[0], persisted, manifest.raw_nbytes, manifest.stored_nbytes, stall[1])

    def delete(self, steps: Sequence[int]) -> None:
        """Delete committed ``steps`` crash-safely (each is renamed out of view, then removed);
        refuses, deleting nothing, if a step that stays needs one of them as a delta base."""
        self._writable()
        self._wait_pending()
        self._collective.agree(lambda: self._tiers.delete(steps), "deleting steps")

    def gc(self, *, delete_damaged: bool = False) -> list[int]:
        """Apply the retention now (``delete_damaged`` first deletes the damaged steps no intact step
        needs, so it counts intact steps only); return the deleted steps (torn leftovers went at open)."""
        self._writable()
        self._wait_pending()
        return self._collective.agree(lambda: self._tiers.collect(delete_damaged), "collecting garbage")

    def _wait_pending(self) -> None:
        if not forked(self._pid):  # in a forked child: the parent's save, no thread of ours
            self._pending.wait()

    def _writable(self) -> Store:
        if self._closed:
            raise CrashsafeError("this CheckpointManager is closed; create a new one")
        refuse_forked(self._pid, "this CheckpointManager")
        if not self.read_only and (store := self._tiers.store) is not None:
            return store
        raise CrashsafeError(f"{self.directory} was opened read_only; open it without read_only=True to save")

    def steps(self) -> list[int]:
        """Committed steps, ascending (of either tier, with a mirror)."""
        if not self._closed:
            self._wait_pending()  # the step just saved is listed; the ranks' exchanges never meet a persist's
        with self._tiers.reading() as stores:
            listed = self._collective.agree(lambda: listed_steps(stores), "listing steps")
            return sorted({step for steps in listed for step in steps})

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        return max(self.steps(), default=None)

    def best_step(self, metric: str, mode: Mode = "min") -> int | None:
        """The committed step with the best ``metric`` (``"min"``: lowest, ``"max"``: highest; ties: the
        newest), of either tier; None if there is no step, NoCheckpointError if none records it."""
        self._wait_pending()

        def find() -> int | None:
            with self._tiers.reading() as stores:
                return best_step(stores, listed_steps(stores), metric, mode)

        return self._collective.agree(find, "finding the best step")  # every rank picks the same

    def manifest(self, step: int | None = None) -> Manifest:
        """The validated manifest of ``step`` (default: the newest)."""
        with self._tiers.reading() as stores:
            return manifest_of(stores, step, self.directory)

    def load(
        self,
        step: StepSpec = None,
        *,
        numpy: bool = False,
        metric: str | None = None,
        mode: Mode = "min",
        mmap: bool = False,
        device: Any = None,
    ) -> dict[str, Any]:
        """The state as saved: tensors, arrays and python values, checksums verified.

        With ``step=None`` the newest intact step is read; damaged newer steps are skipped with a
        :class:`CorruptCheckpointWarning`. An explicit damaged ``step`` raises; so does ``step="best"``
        (the :meth:`best_step` by ``metric`` and ``mode``). ``mmap=True`` (a local directory) gives raw
        payloads as read-only numpy views of the mapped files, never copied (crashsafe/mapping.py).
        ``device`` (e.g. ``"cuda:0"``): tensors are made there, read straight into device memory.
        """
        check_device(device, numpy, mmap)
        began, picked = time.perf_counter(), pick_step(step, metric, mode, self.best_step)

        def load(stores: list[Store]) -> tuple[int, dict[str, Any]] | None:
            rank, coord = self._collective.reader_rank, self._collective.coord  # a rank reads its own part
            if mmap:
                return map_step(stores, picked, rank, coord)
            return read_step(stores, picked, numpy, rank, device, coord)

        loaded = self._read(load)
        if loaded is None:
            raise NoCheckpointError(f"no committed checkpoint in {self.directory}; nothing to load")
        note_read(loaded[0], picked, self.directory, began)
        return loaded[1]

    def restore(
        self,
        state: MutableMapping[str, Any],
        step: StepSpec = None,
        *,
        metric: str | None = None,
        mode: Mode = "min",
    ) -> int | None:
        """Load a checkpoint (``step`` as for :meth:`load`) into ``state``; return its step, or None if none.

        Modules, optimizers and schedulers get ``load_state_dict``; tensors and arrays are read straight
        into (a damaged step found then: see crashsafe/restoring.py); python values in dicts and lists
        are replaced. Mismatches are refused before anything changes, except what only an object's own
        ``load_state_dict`` can judge: if one raises, restore stops there (``docs/state.md``).
        """
        if not isinstance(state, MutableMapping):
            raise UnsupportedStateError(f"restore needs a dict of live objects, not a {type(state).__name__}")
        began, picked = time.perf_counter(), pick_step(step, metric, mode, self.best_step)
        restore = lambda stores: restore_tiers(stores, state, picked, self._collective, self._memory)  # noqa: E731
        found, self.recovery = self._read(restore)
        return note_read(found, picked, self.directory, began)

    def _read(self, read: Callable[[list[Store]], _T]) -> _T:
        """``read(stores)`` once the pending save is committed; damage found resets the planner."""
        if not self.read_only and not self._closed:
            self._wait_pending()
        with self._tiers.reading() as stores, on_damage(self._planner.reset):  # no delta through damage
            return read(stores)

    def _exit_after_preemption(self) -> None:
        self.close()
        raise SystemExit(EXIT_STATUS)

    def close(self) -> None:
        """Wait for the pending save, stop the background thread and release the lock."""
        if self._closed or forked(self._pid):  # in a forked child: its save, lock and lease are the parent's
            return
        try:
            if not self.read_only:
                self._wait_pending()
        finally:
            self._closed = True
            with contextlib.ExitStack() as parts:  # each closes, last pushed first, if another raises
                parts.callback(self._sigterm.close)
                parts.callback(self._tiers.close)  # the mirror, the lock, the store
                parts.callback(self._memory.close if self._memory is not None else lambda: None)
                parts.callback(self._pool.clear if self._pool is not None else lambda: None)
                parts.callback(self._collective.close)
                parts.callback(self._pending.close)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with contextlib.suppress(Exception) if exc is not None else contextlib.nullcontext():
            self.close()  # an error closing never hides the one that ended the block

    def __repr__(self) -> str:  # never waits for a save in flight (its error is the next save's) or a rank
        return f"CheckpointManager({str(self.directory)!r}, steps={self._tiers.listed()})"
