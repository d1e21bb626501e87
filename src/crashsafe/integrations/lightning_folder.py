"""A Lightning checkpoint folder under CrashsafeCheckpointIO: its crashsafe store (``.crashsafe/``,
one step per save) and the pointer files that name its steps (``integrations/pointer.py``).

A step is deleted only when crashsafe let it go and no pointer file in the folder names it: its
name was removed by Lightning (a removal mark stays until its steps are gone) or saved again (the
pointer at its name names a newer step). A step no pointer names for any other reason (its pointer
was moved or copied out of the folder, or deleted by hand) is kept and logged at each open: a
pointer outside its folder cannot load it, and a file moved back names it again (docs/integrations.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crashsafe._log import logger, warn
from crashsafe.errors import (
    CorruptCheckpointError,
    CorruptCheckpointWarning,
    CrashsafeError,
    CrashsafeWarning,
    NoCheckpointError,
)
from crashsafe.format.manifest import Manifest
from crashsafe.integrations.pointer import (
    Folder,
    Pointer,
    mark_removed,
    retire_pointer,
    scan,
    unmark,
    write_pointer,
)
from crashsafe.manager import CheckpointManager

__all__ = ["CheckpointFolder", "Saved", "load_pointed", "saved_steps"]


@dataclass(frozen=True)
class Saved:
    """What a step was saved as: the Lightning file name, and the key its pointers name it by (None
    for a step saved by an older crashsafe)."""

    name: str
    key: str | None


class CheckpointFolder:
    """One Lightning checkpoint directory. A save is numbered (in the training thread, so that its
    pointer can name it before it commits) by Lightning's global step where that is new and above
    every step there (a second save of one global step, ``save_last``'s, takes the next free
    number), so steps stay in save order.

    Removals and the deletion of replaced steps wait for a moment when no save is queued: they are
    garbage, and their fsyncs would delay the next commit."""

    def __init__(self, path: Path, manager: CheckpointManager) -> None:
        self.path = path
        self.mgr = manager
        self.saved = saved_steps(manager)  # step -> what it was saved as
        self.top = max(manager.steps(), default=-1)  # the highest step number used (named or not)
        self.held: set[int] = set()  # steps a kept step's delta still needs: deleted later
        self.removed: set[str] = set()  # names Lightning removed: pointer and steps go at collect()
        self.stale: set[int] = set()  # steps let go: replaced by a newer save of their name, or removed
        self.marks: set[str] = set()  # names whose removal marks go once their steps are gone

    def number(self, global_step: int | None) -> int:
        """The step number of the next save (Lightning's global step, or the next free number)."""
        self.top = self.top + 1 if global_step is None or global_step <= self.top else global_step
        return self.top

    def drop_orphans(self) -> None:
        """At open: delete the steps crashsafe let go before a crash (removed or replaced, as above)
        that no pointer file names; log those no pointer names that it keeps."""
        folder = self._scan()
        if folder is None:
            return
        named = _named(folder, self.saved)
        doomed = {s for s, saved in self.saved.items() if saved.name in folder.removed}
        doomed |= _replaced(folder, self.saved)
        self.marks |= folder.removed
        self._drop(
            sorted(doomed - named), "its file was removed, or saved again, and no pointer file names it"
        )
        kept = sorted(set(self.saved) - named - doomed)
        if kept:
            logger().warning(
                "%s: kept %s, which no pointer file in the folder names (was a file moved or copied out "
                "of it? A pointer loads only beside its %s; move it back to load it). To delete: "
                "CheckpointManager(%r).delete(%s)",
                self.path, ", ".join(f"step {s} (saved as {self.saved[s].name!r})" for s in kept),
                self.mgr.directory, self.mgr.directory, kept,
            )  # fmt: skip
        self._unmark()

    def save(
        self,
        name: str,
        step: int,
        key: str,
        snapshot: Mapping[str, Any],
        metrics: dict[str, float],
        first: bool,
    ) -> float:
        """Commit ``snapshot`` as ``step``, then make ``name``'s pointer name it, durably and with a
        new mtime (a re-save too: Lightning picks the "last" file by mtime); return when it does
        (``time.perf_counter()``). The steps it replaces are deleted at ``collect()``. The directory's
        ``first`` save has no pointer before it commits: a removal mark stands for it till then, so
        a crash in between leaves a step the next writer may delete."""
        if first:
            mark_removed(self.path / name)
            self.marks.add(name)
        self.mgr.save(step, {"name": name, "key": key, **snapshot}, metrics)
        self.saved[step] = Saved(name, key)
        self.removed.discard(name)  # removed, then saved again: it stays
        write_pointer(self.path / name, Pointer(name, step, key, committed=True))
        durable = time.perf_counter()
        if name in self.marks:  # a first save's mark, or an earlier removal's: its steps are replaced
            unmark(self.path / name)
            self.marks.discard(name)
        self.stale.update(s for s, saved in self.saved.items() if saved.name == name and s != step)
        return durable

    def remove(self, name: str) -> None:
        self.removed.add(name)

    @property
    def backlog(self) -> int:
        return len(self.removed) + len(self.stale)

    def collect(self, busy: Callable[[], bool] = lambda: False) -> None:
        """Replace the pointers of removed names by removal marks (durably), then delete their steps
        and the replaced ones that no pointer file names, one at a time, stopping when ``busy()`` (a
        save is waiting); a crash in between leaves the marks, acted on at the next open."""
        for name in sorted(self.removed):
            retire_pointer(self.path / name)
            self.marks.add(name)
            self.stale.update(s for s, saved in self.saved.items() if saved.name == name)
        self.removed.clear()
        if self.stale and not busy():
            folder = self._scan()
            if folder is None:
                return
            named = _named(folder, self.saved)
            for step in sorted(self.stale, reverse=True):
                if busy():
                    return
                self.stale.discard(step)
                if step in named:
                    logger().info("%s: kept step %d (saved as %r): a pointer file names it", self.path, step,
                                  self.saved[step].name)  # fmt: skip
                else:
                    self.delete([step])
        self._unmark()

    def delete(self, steps: Sequence[int]) -> None:
        """Delete ``steps`` (and earlier ones held back), newest first; a step that a kept step's
        delta chain still needs stays until it does not."""
        for step in sorted({*steps, *self.held}, reverse=True):
            try:
                self.mgr.delete([step])
            except CrashsafeError:
                self.held.add(step)
                continue
            self.held.discard(step)
            self.saved.pop(step, None)

    def _drop(self, steps: Sequence[int], why: str) -> None:
        for step in steps:
            logger().info(
                "%s: deleting step %d (saved as %r): %s", self.path, step, self.saved[step].name, why
            )
        self.delete(steps)

    def _scan(self) -> Folder | None:
        """The folder's pointer files; None (and a log line) if it cannot be listed: nothing is
        deleted then."""
        try:
            return scan(self.path)
        except OSError as exc:
            logger().warning(
                "%s cannot be listed (%s): no step is deleted now", self.path, exc.strerror or exc
            )
            return None

    def _unmark(self) -> None:
        """Remove the removal marks whose names have no step left: a step a pointer file still names
        keeps its mark, so it goes once that file does."""
        waiting = {saved.name for saved in self.saved.values()}
        for name in sorted(self.marks - waiting):
            unmark(self.path / name)
            self.marks.discard(name)


def _named(folder: Folder, saved: Mapping[int, Saved]) -> set[int]:
    """The steps the folder's pointer files name: by number and key (a pointer whose key another
    checkpoint's step now bears names nothing), or, a pointer of an older crashsafe naming no step,
    every step saved under its name."""
    pointed = {(p.step, p.key) for p in folder.pointers.values() if p.step is not None}
    names = {p.name for p in folder.pointers.values() if p.step is None}
    return {s for s, v in saved.items() if (s, v.key) in pointed or v.name in names}


def _replaced(folder: Folder, saved: Mapping[int, Saved]) -> set[int]:
    """The steps whose name's pointer file names another step, present, of that name: replaced by a
    save of the name after them (or before them, if a crash cut that save short of its pointer)."""
    current: dict[str, int] = {}
    for file, pointer in folder.pointers.items():
        step = pointer.step
        if (
            step is not None
            and pointer.name == file
            and step in saved
            and saved[step] == Saved(file, pointer.key)
        ):
            current[file] = step
    return {s for s, v in saved.items() if v.name in current and current[v.name] != s}


def saved_steps(manager: CheckpointManager) -> dict[int, Saved]:
    """What each step was saved as, read from its manifest (a step without one is skipped)."""
    saved = {}
    for step in manager.steps():
        try:
            manifest = manager.manifest(step)
        except CrashsafeError:
            continue  # unreadable: never a candidate, and the next writer leaves it to `crashsafe gc`
        if manifest.saved_as is not None:
            saved[step] = Saved(manifest.saved_as, _key(manifest))
    return saved


def _key(manifest: Manifest) -> str | None:
    """The key a Lightning checkpoint's step was saved with (None: saved by an older crashsafe)."""
    keys = manifest.tree.get("keys", [])
    if "key" not in keys:
        return None
    node = manifest.tree["vals"][keys.index("key")]
    return node["v"] if node["t"] == "str" and isinstance(node["v"], str) else None


def load_pointed(
    manager: CheckpointManager, saved: Mapping[int, Saved], pointer: Pointer, path: object
) -> dict[str, Any]:
    """The state of the step ``pointer`` (read at ``path``) names, verified, with fallback past
    damage. A step that was committed and is gone (its number now another checkpoint's, or none) is
    a NoCheckpointError: another step is never loaded in its place. A save that never committed (a
    crash before: the pointer of a new name is written before its step commits, and Lightning may
    link ``last.ckpt`` to it at once) loads the newest committed step of the directory, warned."""
    step = pointer.step
    if step is None:
        return _load_named(manager, saved, pointer.name)
    present = step in manager.steps()
    if present and saved.get(step, Saved(pointer.name, pointer.key)).key == pointer.key:
        older = sorted((s for s, v in saved.items() if v.name == pointer.name and s < step), reverse=True)
        return _load_first(manager, saved, [step, *older], pointer.name)
    if pointer.committed:
        now = (
            f"; step {step} there now is another checkpoint, saved as {saved[step].name!r}" if present else ""
        )
        raise NoCheckpointError(
            f"{path} names step {step} of {manager.directory} (saved as {pointer.name!r}), which was "
            f"committed but is gone{now}: it was deleted (crashsafe deletes a step only once no pointer "
            "file in its folder names it, but a file moved out of the folder names nothing there). No "
            f"other checkpoint is loaded in its place; `crashsafe ls {manager.directory}` lists those left"
        )
    return _load_first(manager, saved, [], pointer.name)


def _load_named(manager: CheckpointManager, saved: Mapping[int, Saved], name: str) -> dict[str, Any]:
    """For a pointer naming no step: the newest intact step saved as ``name``, as its crashsafe did."""
    return _load_first(
        manager, saved, sorted((s for s, v in saved.items() if v.name == name), reverse=True), name
    )


def _load_first(
    manager: CheckpointManager, saved: Mapping[int, Saved], mine: list[int], name: str
) -> dict[str, Any]:
    """The first intact step of ``mine``; if none is, the newest intact step of the directory (each
    fallback warned about: past damage, or past a save of ``name`` that never committed)."""
    others = sorted((s for s in saved if s not in mine), reverse=True)
    damage: list[str] = []
    for candidates in (mine, others):
        if candidates is others and others:
            newest = saved[others[0]].name
            warn(
                f"no intact checkpoint saved as {name!r}; loading {newest!r} (or an older one), the newest "
                "intact checkpoint of the directory"
                if mine
                else f"the save of {name!r} did not commit before its run stopped; loading {newest!r} (or an "
                "older one), the newest committed checkpoint of the directory",
                CorruptCheckpointWarning if mine else CrashsafeWarning,
            )
        for step in candidates:
            try:
                return manager.load(step)
            except CorruptCheckpointError as exc:
                damage.append(str(exc))
                warn(f"skipping damaged checkpoint: {exc}", CorruptCheckpointWarning)
                logger().warning("fell back from step %d because %s", step, exc)
    if not saved and not mine:
        raise NoCheckpointError(
            f"{name!r} names a save that did not commit before its run stopped, and {manager.directory} "
            "holds no committed checkpoint: delete that file (and any link to it) to start afresh"
        )
    raise CorruptCheckpointError(
        f"no intact checkpoint for {name!r} in {manager.directory}: {'; '.join(damage)}"
    )
