"""Where a manager's steps live: its own store (a local directory or an object store) and, when it
has one, a mirror that every committed step is copied to; each tier's retention, the writer's lock
and its catalog of committed steps, and the stores a read goes through, local tier first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from crashsafe._log import logger, warn
from crashsafe.catalog import Catalog
from crashsafe.errors import CrashsafeError, NoCheckpointError, RetentionWarning
from crashsafe.format.manifest import Manifest
from crashsafe.loading import listed_steps
from crashsafe.mirroring import Mirror
from crashsafe.policies.keep import KeepPolicy
from crashsafe.storage.base import Lock, Store
from crashsafe.storage.stores import anchored, is_url, open_store

__all__ = ["Tiers"]


class Tiers:
    """The locations of one manager and what a writer holds of them (see the module doc)."""

    def __init__(
        self,
        directory: str,
        mirror: str | None,
        keep: KeepPolicy | None,
        mirror_keep: KeepPolicy | None,
        storage_options: Mapping[str, Any],
    ) -> None:
        self.directory, self.mirror = directory, mirror
        self.keep, self.mirror_keep = keep, mirror_keep
        self.storage_options = dict(storage_options)
        self._anchored = {p: anchored(p) for p in (directory, mirror) if p}  # a later chdir moves nothing
        self._where = self._anchored.get(directory, directory)  # what verify checks: the store's own steps
        self.store: Store | None = None  # a writer's store, held open for its lifetime
        self.catalog: Catalog | None = None  # a writer's: its store's committed steps
        self.closed = False
        self._lock: Lock | None = None
        self._mirror: Mirror | None = None

    def open(self, location: str, create: bool = False, existing: bool = False) -> Store:
        options = self.storage_options if is_url(location) else None
        where = self._anchored.get(location, location)
        return open_store(where, storage_options=options, create=create, existing=existing)

    def open_writer(self, leader: bool) -> None:
        """Open the store to write: the ``leader`` (rank 0, or one process) creates, locks and cleans
        it and starts the mirror; the other ranks open what it made."""
        self.store = self.open(self.directory, create=leader)
        self.catalog = Catalog(self.store)
        if not leader:
            return
        self._lock = self.store.lock()
        self.store.remove_leftovers(self.store.leftovers())
        mirror = self.mirror
        if mirror is not None:  # (one that does not answer now is connected in the background)
            self._mirror = Mirror(self.catalog, lambda create: self.open(mirror, create), self.mirror_keep)

    def check(self, doing: str) -> None:
        """Refuse to go on if the location was deleted or replaced under this writer, or its lock
        was lost: writing on would fork the run."""
        assert self.store is not None
        self.store.check_current(doing)
        if self._lock is not None:
            self._lock.check()

    def before_save(self) -> None:
        """Tell what went wrong with the mirror since the last save, and try its failed steps again."""
        if self._mirror is not None:
            self._mirror.report()
            self._mirror.retry()

    def committed(self, manifest: Manifest) -> None:
        """A step was committed (by this writer, or the ranks together): note it, hand it to the mirror."""
        assert self.catalog is not None
        self.catalog.committed(manifest)
        if self._mirror is not None:
            self._mirror.add(manifest.step)

    def retain(self, saved: int | None) -> list[int]:
        """Delete what the retention policy drops, except steps a kept step's delta chain needs and
        the step just ``saved`` (even when it is older than others, e.g. after a rewind), and steps
        not yet copied to the mirror; return them."""
        assert self.catalog is not None
        keep = {saved} if saved is not None else set()
        if self._mirror is not None:
            keep |= self._mirror.unmirrored()
        return self.catalog.retain(self.keep, keep)

    def retain_after(self, saved: int | None) -> None:
        """Retention once ``saved`` is committed: a failed deletion warns, never fails the save."""
        try:
            self.retain(saved)
        except CrashsafeError as exc:
            done = f"step {saved} is committed, but " if saved is not None else ""
            failed = f"{done}deleting old steps failed: {exc}. Retention tries again after the next save"
            warn(f"{failed} (or run `crashsafe gc`)", RetentionWarning)
            logger().warning("%s", failed)

    def make_room(self, step: int) -> None:
        """Before a committed ``step`` is saved again: delete it if it is damaged and nothing intact
        needs it (CheckpointExistsError otherwise)."""
        from crashsafe.verification import verify

        def intact(steps: list[int]) -> bool:  # any of them
            return bool(verify(self._where, steps=steps, storage_options=self.storage_options).intact)

        assert self.catalog is not None
        self.catalog.make_room(step, intact, self.directory)

    def delete(self, steps: Iterable[int]) -> None:
        """Delete the committed ones of ``steps``, or none if a step that stays needs one of them."""
        self.check("deleting steps")
        assert self.catalog is not None
        self.catalog.delete_asked(steps)

    def collect(self, delete_damaged: bool) -> list[int]:
        """Retention now (``delete_damaged``: first the damaged steps no intact step needs); return the
        deleted steps. What the mirror lacks stays."""
        from crashsafe.verification import verify

        self.check("collecting garbage")
        assert self.catalog is not None
        damaged: set[int] = set()
        if delete_damaged:
            report = verify(self._where, storage_options=self.storage_options)
            damaged = {r.step for r in report.damaged} - self.catalog.needed(report.intact)
            self.catalog.delete(sorted(damaged))
        return sorted(damaged | set(self.retain(None)))

    def wait_mirror(self, timeout: float | None) -> bool:
        """Until every committed step is in the mirror (or failed to be, for now); True when none is
        left. Failures are reported as MirrorWarning; steps just mirrored may go locally."""
        if self._mirror is None:
            return True
        done = self._mirror.wait(timeout)
        self._mirror.report()
        if self.store is not None and not self.closed:
            self.retain(None)
        return done

    @contextlib.contextmanager
    def reading(self) -> Iterator[list[Store]]:
        """The stores to read, local tier first: a writer's own, or (readers) the locations opened
        afresh, so a reader follows a replaced directory; a missing one is empty beside a mirror."""
        with contextlib.ExitStack() as stack:
            stores: list[Store] = []
            if self.store is not None and not self.closed:
                stores.append(self.store)
            else:
                try:
                    stores.append(stack.enter_context(contextlib.closing(self.open(self.directory))))
                except NoCheckpointError:
                    if self.mirror is None:
                        raise
            if self._mirror is not None and not self.closed:
                stores.append(self._mirror.remote)
            elif self.mirror is not None:
                stores.append(stack.enter_context(contextlib.closing(self.open(self.mirror))))
            yield stores

    def listed(self) -> list[int]:
        """The committed steps of every tier as this process lists them now, ascending."""
        with self.reading() as stores:
            return sorted({step for steps in listed_steps(stores) for step in steps})

    def close(self) -> None:
        """Let the mirror finish (then what is mirrored may go locally), release the lock and the store."""
        self.closed = True
        try:
            if self._mirror is not None:
                self._mirror.close()  # the last steps reach the mirror before the job ends
                self._mirror.report()
                if self.store is not None:
                    self.retain_after(None)
        finally:
            if self._lock is not None:
                self._lock.release()
            if self.store is not None:
                self.store.close()
