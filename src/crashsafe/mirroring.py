"""The second tier: every step committed locally is copied to a mirror (an object store) in the
background, verified after upload, and pruned there by its own retention.

Training never waits for the mirror: a step is handed over once it is committed locally, and a
background thread uploads steps oldest first, so a delta's base always reaches the mirror before
the delta, and the step holding bytes that later steps refer to before them (those bytes are
uploaded once). That thread and the I/O threads it starts run at a lower CPU priority
(:mod:`crashsafe.storage.background`), so reading, checksumming and uploading a step take the
cores only when training leaves them. Until a step is mirrored, local retention keeps it (and its
bases, and the steps it refers to); a step counts as mirrored only once the mirror's bytes of it
are known intact: read back and checksummed after its upload, or, for a step the mirror already
held when the manager opened, read back and checksummed then (a manifest that matches says
nothing of the shards), and its references hold there. A failed
upload is reported as a :class:`MirrorWarning` at the next save and retried then; nothing local is
at risk. A mirror whose lease expired while it did not answer uploads again once a renewal goes
through; one whose lease another writer took stays stale, and says so at each save and at close.
A mirror that does not answer when the manager opens is no reason not to train: the manager opens
with a warning, and the mirror's thread connects (creates the location, takes the lease, cleans
leftovers) at the next save that finds it answering, as after an outage.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from crashsafe._log import logger, warn
from crashsafe.catalog import Catalog
from crashsafe.copying import check_copy, copy_step
from crashsafe.errors import (
    CorruptCheckpointError,
    CrashsafeError,
    MirrorWarning,
    NoCheckpointError,
    StorageError,
)
from crashsafe.policies.keep import KeepPolicy
from crashsafe.storage.background import lower_thread_priority
from crashsafe.storage.base import Lock, Store
from crashsafe.storage.reader import read_manifest
from crashsafe.storage.retry import is_transient

__all__ = ["Mirror", "copy_step"]

MIRROR_NICE = 10  # the mirror's threads get ~1/10 of a core against a training thread that wants it


class Mirror:
    """Copies steps from ``local`` to the mirror in a background thread; owns the mirror's lock.
    ``open_remote(create)`` opens the mirror: at once, or (it does not answer) in the background."""

    def __init__(self, local: Catalog, open_remote: Callable[[bool], Store], keep: KeepPolicy | None) -> None:
        self.local, self.keep, self._open_remote = local.store, keep, open_remote
        self._local = local  # the manager's catalog of its store: what unmirrored steps need
        self._lock: Lock | None = None  # the mirror's lease, once connected
        remote: Store | None = None
        try:
            self.remote = remote = open_remote(True)
            self._connect()  # the lease is renewed at full priority
        except StorageError as exc:
            if not is_transient(exc.__cause__ or exc):
                if remote is not None:
                    remote.close()
                raise
            self.remote = remote or open_remote(False)  # (an object store: opened without a request)
            message = (
                f"the mirror {self.remote.location} cannot be reached ({exc}). Training goes on without it: "
                "steps are saved locally and kept there until mirrored; the mirror is tried again at each "
                "save and the steps are uploaded once it answers"
            )
            warn(message, MirrorWarning)
            logger().warning("%s", message)
        self._target = self.remote  # where the mirror thread copies to (remote.background() once it runs)
        self._catalog = Catalog(self._target)  # the mirror's steps' bases and facts, and its deletions
        # every local step until the mirror thread finds the very save there: a step of a previous
        # run may be unmirrored, or saved again (after a rewind) while the mirror holds an older save
        self._pending = set(self.local.steps())
        self._errors: list[str] = []
        self._failed_round: set[int] = set()  # failed since the last save; retried at the next
        self._busy = False
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="crashsafe-mirror", daemon=True)
        self._thread.start()

    def add(self, step: int) -> None:
        """Hand over a step just committed locally."""
        with self._cond:
            self._pending.add(step)
            self._cond.notify_all()

    def unmirrored(self) -> frozenset[int]:
        """Local steps that must stay until mirrored: the pending ones and every base they need."""
        with self._cond:
            pending = frozenset(self._pending)
        return pending | self._local.needed(pending)

    def report(self) -> None:
        """Warn (in the caller's thread) about what went wrong since the last report."""
        with self._cond:
            errors, self._errors = self._errors, []
        for error in errors:
            warn(error, MirrorWarning)
            logger().warning("%s", error)

    def _note(self, message: str) -> None:
        with self._cond:
            self._errors.append(message)

    def _failed(self, step: int, message: str) -> None:
        """A step not mirrored this round: said at the next report, retried at the next save."""
        with self._cond:
            self._failed_round.add(step)
            missing = sorted(self._pending)
        lacks = f"steps {missing}" if len(missing) > 1 else f"step {step}"
        self._note(f"{message}; the step stays local, retried at the next save (the mirror lacks {lacks})")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every pending step is mirrored (or failed this round); True if none is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (self._pending - self._failed_round) or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            return not self._pending

    def _connect(self, create: bool = False) -> None:
        """Take the mirror's lease and remove earlier writers' leftovers; with ``create``, create its
        location first (the open does that, unless the mirror did not answer then)."""
        if create:
            self._open_remote(True).close()
        self._lock = self.remote.lock()
        self.remote.remove_leftovers(self.remote.leftovers())

    def _background(self) -> None:
        try:
            self._target = self._catalog.store = self.remote.background()  # its I/O threads start here
        except (CrashsafeError, OSError) as exc:
            where = self.remote.location
            self._note(f"opening {where} for background uploads failed: {exc}; the writer's client uploads")

    def _connected(self, todo: list[int]) -> bool:
        """Whether the mirror is connected, connecting it first if it did not answer before (its
        lease then renews from this thread; its requests run on fsspec's loop, at full priority)."""
        if self._lock is not None:
            return True
        try:
            self._connect(create=True)
        except (CrashsafeError, OSError) as exc:
            with self._cond:
                self._failed_round.update(todo)
                missing = sorted(self._pending)
            self._note(
                f"connecting to the mirror {self.remote.location} failed ({exc}); the steps stay local, "
                f"tried again at the next save (the mirror lacks steps {missing})"
            )
            return False
        logger().warning("the mirror %s answers again: uploading steps %s", self.remote.location, todo)
        self._background()
        return True

    def _run(self) -> None:
        lower_thread_priority(MIRROR_NICE)
        if self._lock is not None:
            self._background()
        try:
            self._serve()
        finally:
            if self._target is not self.remote:
                self._target.close()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not (self._pending - self._failed_round) and not self._closing:
                    self._cond.wait()
                todo = sorted(self._pending - self._failed_round)
                if not todo:
                    return
                self._busy = True
            if self._connected(todo):
                for step in todo:  # oldest first: bases before their deltas
                    self._mirror(step)
                self._prune()
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _mirror(self, step: int) -> None:
        assert self._lock is not None  # (connected)
        try:
            self._lock.check()  # an expired or lost lease uploads nothing (its shards would be garbage)
            there = step in self._target.steps()
            if there and not self._same(step):
                self._drop_stale(step)
                there = False
            if there and (problem := self._damage(step)) is not None:
                self._replace_damaged(step, problem)
                there = False
            if not there:
                copy_step(self.local, self._target, step)  # verified after upload
                self._catalog.forget([step])  # a step saved again after a deletion: facts anew
        except (CrashsafeError, OSError) as exc:
            if not (isinstance(exc, NoCheckpointError) and self._gone(step)):
                self._failed(step, f"mirroring step {step} to {self.remote.location} failed: {exc}")
                return
        with self._cond:  # mirrored and verified, or gone locally (deleted by the user)
            self._pending.discard(step)

    def _gone(self, step: int) -> bool:
        """Whether ``step`` is no longer committed locally (so there is nothing to mirror)."""
        try:
            return not self.local.has_step(step)
        except (CrashsafeError, OSError):
            return False

    def _same(self, step: int) -> bool:
        """Whether the mirror's ``step`` is the local one by its manifest (not an older save of that
        step number, which a run that rewound, after its local copy was deleted, saved again, nor
        one whose manifest is damaged)."""
        mine = read_manifest(self.local, step)
        try:
            theirs = read_manifest(self._target, step)
        except CorruptCheckpointError:
            return False
        return mine.created == theirs.created and [e.xxh3 for e in mine.payloads] == [
            e.xxh3 for e in theirs.payloads
        ]

    def _damage(self, step: int) -> str | None:
        """What is wrong with the mirror's bytes of ``step`` (each payload read back and
        checksummed, each reference checked), or None: a matching manifest says nothing of the shards
        it names."""
        try:
            check_copy(self._target, step)
        except CorruptCheckpointError as exc:
            return str(exc)
        return None

    def _replace_damaged(self, step: int, problem: str) -> None:
        """Delete the mirror's damaged copy of ``step`` once the local copy is known intact (it is
        the same save, byte for byte by its checksums: steps that need it as a delta base read it
        again once the copy is uploaded)."""
        check_copy(self.local, step)
        self._note(
            f"the mirror's copy of step {step} in {self.remote.location} is damaged ({problem}); "
            "it is replaced by the local copy, which stays until the new upload is verified"
        )
        self._catalog.delete([step])

    def _drop_stale(self, step: int) -> None:
        """Delete the mirror's older save of ``step``, unless a mirrored step needs it (a delta base,
        or a step whose bytes it refers to)."""
        others = set(self._target.steps()) - {step}
        if step in self._catalog.needed(others):
            raise CrashsafeError(
                f"the mirror's step {step} is an older save than the local one, and mirrored steps "
                "need it (as a delta base, or for the bytes they refer to): the local step is not "
                "mirrored. Delete the mirror's later steps (crashsafe gc on the mirror) to let it through"
            )
        self._catalog.delete([step])

    def _prune(self) -> None:
        assert self._lock is not None  # (connected)
        try:
            self._lock.check()
        except CrashsafeError:
            return  # no lease, no deletion: each step's failure said why
        try:
            self._catalog.retain(self.keep)
        except (CrashsafeError, OSError) as exc:
            where = self.remote.location
            self._note(f"applying retention in {where} failed: {exc}; it is applied again after an upload")

    def retry(self) -> None:
        """Try failed steps again (called at each save)."""
        with self._cond:
            if self._failed_round:
                self._failed_round = set()
                self._cond.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Finish the pending uploads (so a finished job's last step is in the mirror; steps that
        failed are tried once more while the lease holds), then stop; steps still not mirrored are
        reported (the mirror is stale)."""
        with contextlib.suppress(CrashsafeError):
            if self._lock is not None:  # (a mirror never connected is not tried again as the job ends)
                self._lock.check()
                self.retry()
        self.wait(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            stale = sorted(self._pending)
        if stale:
            self._note(
                f"closing with steps {stale} not in the mirror {self.remote.location}: the mirror is stale. "
                "They stay in the local directory; a manager opened with this mirror uploads them"
            )
        self._thread.join()
        if self._lock is not None:
            self._lock.release()
        self.remote.close()
