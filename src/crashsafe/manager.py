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
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

from crashsafe._log import logger, warn
from crashsafe._metrics import clean_metrics
from crashsafe._runtime import forked, refuse_forked
from crashsafe.chain import direct_bases, doomed_steps, protected_steps
from crashsafe.distributed.collective import collective_for
from crashsafe.distributed.group import DEFAULT_TIMEOUT
from crashsafe.distributed.saving import Listing, save_step
from crashsafe.encoding import CodecSpec, SavePlanner
from crashsafe.errors import (
    CheckpointExistsError,
    CorruptCheckpointWarning,
    CrashsafeError,
    NoCheckpointError,
    RetentionWarning,
    UnsupportedStateError,
)
from crashsafe.format.manifest import Manifest, checked_step
from crashsafe.loading import check_device, first_intact, listed_steps, note_read, on_damage, read_state
from crashsafe.mapping import map_step
from crashsafe.mirroring import Mirror
from crashsafe.pending import PendingSave
from crashsafe.policies.base import EverySteps, SaveContext, SavePolicy
from crashsafe.policies.keep import Mode, StepFacts
from crashsafe.policies.retention import UNSET, KeepSpec, Unset, retention_policy
from crashsafe.preemption import EXIT_STATUS, SigtermWatch
from crashsafe.restoring import restore_into
from crashsafe.saving import SaveStats, Snapshot, take_snapshot
from crashsafe.state.staging import StagingPool
from crashsafe.step_facts import StepSpec, best_step, pick_step
from crashsafe.storage.base import Lock, Store
from crashsafe.storage.reader import read_manifest
from crashsafe.storage.stores import is_url, open_store
from crashsafe.storage.writer import delete_steps

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
    ) -> None:
        self.keep = retention_policy(keep, keep_last, keep_every, default_last=3)  # None: keep every step
        self._mirror_keep = retention_policy(mirror_keep, mirror_keep_last, mirror_keep_every, "mirror_")
        self.directory = os.fspath(directory)
        self.mirror = None if mirror is None else os.fspath(mirror)
        self._storage_options = dict(storage_options or {})
        self.async_save = async_save
        self.read_only = read_only
        self.policy: SavePolicy = policy if policy is not None else EverySteps(1)
        self._planner = SavePlanner(codec, lossless)
        self._bases: dict[int, frozenset[int]] = {}  # step -> steps its deltas need (cache)
        self._facts: dict[int, StepFacts] = {}  # step -> its commit time and metrics (cache)
        self._listed: set[int] | None = None  # the steps the last background save listed, and it
        self._lock: Lock | None = None
        self._store: Store | None = None  # a writer's store, held open for its lifetime
        self._mirror: Mirror | None = None
        self._pool = StagingPool(pinned_bytes) if async_save else None
        self._pending = PendingSave(background=async_save)
        self._started = time.perf_counter()
        self._stalled = 0.0
        self._last_save: tuple[int, float] | None = None
        self._sigterm = SigtermWatch(False)
        self._closed = False
        self._pid = os.getpid()  # a forked child may read with this manager: never write, wait or release
        self._collective = collective_for(process_group, coordination_timeout, self.mirror)
        if read_only:
            if self.mirror is None:
                self._open(self.directory, existing=True).close()  # it must exist
            return
        try:  # rank 0 creates, locks and cleans; then the others open what it made
            self._collective.agree(self._open_writer, f"opening {self.directory}")
            if not self._collective.leader:
                self._store = self._open(self.directory)
        except BaseException:
            self.close()
            raise
        self._sigterm = SigtermWatch(save_on_sigterm)

    def _open_writer(self) -> None:
        self._store = self._open(self.directory, create=True)
        self._lock = self._store.lock()
        self._store.remove_leftovers(self._store.leftovers())
        mirror = self.mirror
        if mirror is not None:  # (one that does not answer now is connected in the background)
            self._mirror = Mirror(self._store, lambda create: self._open(mirror, create), self._mirror_keep)

    # ----------------------------------------------------------------------------- saving

    def save(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None = None) -> None:
        """Checkpoint ``state`` as ``step``. Returns once the state is copied (async) or committed."""
        store = self._writable()
        step = checked_step(step)
        if not isinstance(state, Mapping):
            raise UnsupportedStateError(f"state must be a dict of named values, got a {type(state).__name__}")
        begin = time.perf_counter()
        self._wait_pending()
        if self._mirror is not None:
            self._mirror.report()
            self._mirror.retry()
        self._check_store(store, f"saving step {step}")
        cleaned = clean_metrics(metrics)
        checked = bool(self._pending.stats)  # a save committed: the state's layout was checked in full
        replicas = self._collective.replicas
        snapshot, planned = take_snapshot(state, store, self._pool, replicas, checked=checked)
        known = self._listed is None or step in self._listed  # else new: this writer holds the lock
        if self._collective.committed(store, step, planned, known):
            self._replace_damaged(store, step)
        stall = time.perf_counter() - begin
        self._stalled += stall
        self._last_save = (step, self._train_time())

        def persist() -> SaveStats:
            return self._persist(store, step, planned, snapshot, cleaned, stall)

        self._stalled += self._pending.start(step, persist, begin)  # sync: it waited for the commit too
        if self._sigterm.arrived:
            self._exit_after_preemption()

    def _replace_damaged(self, store: Store, step: int) -> None:
        """Saving a committed step is refused, unless that step is damaged: a run that fell back
        from it and trained on saves it again, so the damaged one is deleted first (with a warning).
        Refused too if an intact step is a delta of it: the new save would leave that one unreadable."""

        def check() -> None:
            from crashsafe.verification import verify

            later = [s for s in store.steps() if s > step]  # none, unless the run went back
            needs = [s for s in later if step in protected_steps(store, [s], self._bases)]
            if verify(self.directory, steps=[step, *needs], storage_options=self._storage_options).intact:
                raise CheckpointExistsError(
                    f"step {step} is already committed in {self.directory} (or it is damaged, but a newer "
                    "intact step is a delta of it); committed checkpoints are never overwritten. Save under "
                    "a new step, or delete it with `crashsafe gc`."
                )
            self._delete(store, [step])

        self._by_leader(check, f"saving step {step}")
        message = f"step {step} was committed but damaged; it was deleted and is saved again"
        warn(message, CorruptCheckpointWarning)

    def maybe_save(
        self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None = None
    ) -> bool:
        """Save if the policy says so (or a SIGTERM arrived); return whether it saved. Distributed, rank
        0's policy decides for every rank (each rank's own clock would decide apart)."""
        if self._sigterm.arrived:
            if self._last_save is None or self._last_save[0] != step:
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
        stats = self._pending.stats[-5:]
        return SaveContext(
            step=step,
            train_time=self._train_time(),
            last_save_step=self._last_save[0] if self._last_save else None,
            last_save_train_time=self._last_save[1] if self._last_save else None,
            stall=sum(s.stall for s in stats) / len(stats) if stats else None,
            persist=sum(s.persist for s in stats) / len(stats) if stats else None,
            saves=len(self._pending.stats),
            metrics=dict(metrics or {}),
        )

    def wait(self) -> None:
        """Block until every pending save is committed; raise its error if it failed."""
        self._wait_pending()

    def wait_mirror(self, timeout: float | None = None) -> bool:
        """Block until every committed step is copied to the mirror (or failed to be, for now);
        True when none is left to copy. Failures are reported as MirrorWarning."""
        self._wait_pending()
        if self._mirror is None:
            return True
        done = self._mirror.wait(timeout)
        self._mirror.report()
        if self._store is not None and not self._closed:
            self._apply_retention(self._store, None)  # steps just mirrored may go locally now
        return done

    @property
    def stats(self) -> list[SaveStats]:
        """Costs of the saves this manager committed, oldest first."""
        return list(self._pending.stats)

    @property
    def preempted(self) -> bool:
        """True once SIGTERM arrived (with ``save_on_sigterm=True``)."""
        return self._sigterm.arrived

    def _train_time(self) -> float:
        return time.perf_counter() - self._started - self._stalled

    def _persist(
        self,
        store: Store,
        step: int,
        planned: Listing,  # what the ranks agreed, or PLAN_LATER
        snapshot: Callable[[], Snapshot],
        metrics: dict[str, Any],
        stall: float,
    ) -> SaveStats:
        begin = time.perf_counter()
        info = {"crashsafe": _VERSION}
        tree, leaves, arrays = snapshot()
        manifest, listed = save_step(
            self._collective.replicas, store, self._planner, step, planned, tree, leaves, arrays,
            metrics, info, functools.partial(self._replace_damaged, store),
        )  # fmt: skip
        persisted = time.perf_counter() - begin  # committed, and every rank heard it; retention comes after
        self._listed = {*listed, step}
        self._committed(manifest)
        if self._mirror is not None:
            self._mirror.add(step)
        if self._collective.leader:
            self._retain_after(store, step)
        return SaveStats(step, stall, persisted, manifest.raw_nbytes, manifest.stored_nbytes)

    def _retain_after(self, store: Store, saved: int | None) -> None:
        """Retention once ``saved`` is committed (rank 0's, for all): a failed deletion warns, never fails."""
        try:
            self._apply_retention(store, saved)
        except CrashsafeError as exc:
            done = f"step {saved} is committed, but " if saved is not None else ""
            failed = f"{done}deleting old steps failed: {exc}. Retention tries again after the next save"
            warn(f"{failed} (or run `crashsafe gc`)", RetentionWarning)
            logger().warning("%s", failed)

    def _committed(self, manifest: Manifest) -> None:
        """Cache a committed step's delta bases and facts from its manifest (a re-saved step's anew)."""
        self._bases[manifest.step] = direct_bases(manifest)
        self._facts[manifest.step] = StepFacts(manifest.created, manifest.metrics)

    def _apply_retention(self, store: Store, saved: int | None) -> list[int]:
        """Delete what the retention policy drops, except steps a kept step's delta chain needs and
        the step just ``saved`` (even when it is older than others, e.g. after a rewind), and steps
        not yet copied to the mirror."""
        keep = {saved} if saved is not None else set()
        if self._mirror is not None:
            keep |= self._mirror.unmirrored()
        doomed = doomed_steps(store, self.keep, self._bases, keep=keep, facts=self._facts)
        self._delete(store, doomed)
        return doomed

    def _delete(self, store: Store, steps: list[int]) -> None:
        delete_steps(store, steps)  # dependants before their bases
        for step in steps:  # and their cached facts
            self._bases.pop(step, None)
            self._facts.pop(step, None)

    def delete(self, steps: Sequence[int]) -> None:
        """Delete committed ``steps`` crash-safely (each is renamed out of view, then removed);
        refuses, deleting nothing, if a step that stays needs one of them as a delta base."""
        store = self._writable()
        self._wait_pending()

        def delete() -> None:
            self._check_store(store, "deleting steps")
            committed = store.steps()
            doomed = sorted(set(steps) & set(committed))
            staying = [s for s in committed if s not in doomed]
            needed = sorted(protected_steps(store, staying, self._bases) & set(doomed))
            if needed:
                raise CrashsafeError(
                    f"cannot delete step {needed[0]}: a step that stays is a delta of it. Delete the "
                    "steps that depend on it too, or keep it"
                )
            self._delete(store, doomed)

        self._by_leader(delete, "deleting steps")

    def gc(self, *, delete_damaged: bool = False) -> list[int]:
        """Apply the retention now (``delete_damaged`` first deletes the damaged steps no intact step
        needs, so it counts intact steps only); return the deleted steps (torn leftovers went at open)."""
        from crashsafe.verification import verify

        store = self._writable()
        self._wait_pending()

        def collect() -> list[int]:
            self._check_store(store, "collecting garbage")
            damaged: set[int] = set()
            if delete_damaged:
                report = verify(self.directory, storage_options=self._storage_options)
                needed = protected_steps(store, report.intact, self._bases)
                damaged = {r.step for r in report.damaged} - needed
                self._delete(store, sorted(damaged))
            return sorted(damaged | set(self._apply_retention(store, None)))  # what the mirror lacks stays

        return self._by_leader(collect, "collecting garbage")

    def _by_leader(self, fn: Callable[[], _T], what: str) -> _T:
        """``fn`` run here (one process), or by rank 0 for every rank of a distributed manager, which
        all get its result or its error: one process deletes, so no two ranks race."""
        return self._collective.agree(fn, what)

    def _wait_pending(self) -> None:
        if not forked(self._pid):  # in a forked child: the parent's save, no thread of ours
            self._pending.wait()

    def _writable(self) -> Store:
        if self._closed:
            raise CrashsafeError("this CheckpointManager is closed; create a new one")
        refuse_forked(self._pid, "this CheckpointManager")
        if self.read_only or self._store is None:
            raise CrashsafeError(
                f"{self.directory} was opened read_only; open it without read_only=True to save"
            )
        return self._store

    def _check_store(self, store: Store, doing: str) -> None:
        """Refuse to go on if the location was deleted or replaced under this writer, or its lock
        was lost: writing on would fork the run."""
        store.check_current(doing)
        if self._lock is not None:
            self._lock.check()

    def _open(self, location: str, create: bool = False, existing: bool = False) -> Store:
        options = self._storage_options if is_url(location) else None
        return open_store(location, storage_options=options, create=create, existing=existing)

    @contextlib.contextmanager
    def _reading(self) -> Iterator[list[Store]]:
        """The stores to read, local tier first: a writer's own, or (readers) the locations opened
        afresh, so a reader follows a replaced directory; a missing one is empty beside a mirror."""
        with contextlib.ExitStack() as stack:
            stores: list[Store] = []
            if self._store is not None and not self._closed:
                stores.append(self._store)
            else:
                try:
                    stores.append(stack.enter_context(contextlib.closing(self._open(self.directory))))
                except NoCheckpointError:
                    if self.mirror is None:
                        raise
            if self._mirror is not None and not self._closed:
                stores.append(self._mirror.remote)
            elif self.mirror is not None:
                stores.append(stack.enter_context(contextlib.closing(self._open(self.mirror))))
            yield stores

    def steps(self) -> list[int]:
        """Committed steps, ascending (of either tier, with a mirror)."""
        if not self._closed:
            self._wait_pending()  # the step just saved is listed; the ranks' exchanges never meet a persist's
        with self._reading() as stores:
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
            with self._reading() as stores:
                return best_step(stores, listed_steps(stores), metric, mode)

        return self._by_leader(find, "finding the best step")  # every rank picks the same

    def manifest(self, step: int | None = None) -> Manifest:
        """The validated manifest of ``step`` (default: the newest)."""
        with self._reading() as stores:
            if step is None:
                steps = sorted({s for listed in listed_steps(stores) for s in listed})
                if not steps:
                    raise NoCheckpointError(f"no committed checkpoint in {self.directory}")
                step = steps[-1]
            found = first_intact(stores, step, lambda store, at, last: read_manifest(store, at))
            assert found is not None  # a step asked for is read or raises
            return found[1]

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
            if mmap:
                return map_step(stores, picked)
            rank = self._collective.reader_rank
            read = lambda store, at, last: read_state(store, at, numpy, rank, None, device)  # noqa: E731
            return first_intact(stores, picked, read, self._collective.coord)

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
        found = self._read(lambda stores: restore_into(stores, state, picked, self._collective))
        return note_read(found, picked, self.directory, began)

    def _read(self, read: Callable[[list[Store]], _T]) -> _T:
        """``read(stores)`` once the pending save is committed; damage found resets the planner."""
        if not self.read_only and not self._closed:
            self._wait_pending()
        with self._reading() as stores, on_damage(self._planner.reset):  # no delta onto a chain with damage
            return read(stores)

    # ----------------------------------------------------------------------------- lifecycle

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
            self._pending.close()
            self._collective.close()
            if self._mirror is not None:
                self._mirror.close()  # the last steps reach the mirror before the job ends
                self._mirror.report()
                if self._store is not None:
                    self._retain_after(self._store, None)  # what is mirrored may go locally
            if self._pool is not None:
                self._pool.clear()
            if self._lock is not None:
                self._lock.release()
            if self._store is not None:
                self._store.close()
            self._sigterm.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with contextlib.suppress(Exception) if exc is not None else contextlib.nullcontext():
            self.close()  # an error closing never hides the one that ended the block

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.directory)!r}, steps={self.steps()})"
