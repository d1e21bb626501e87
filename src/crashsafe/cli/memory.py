"""``crashsafe ls`` and ``verify`` of a memory tier's directory (``/dev/shm/run``): its part stores
``rank_<r>`` (each an ordinary store of rank r's parts, and of copies of other ranks' parts a host
keeps), every step verified as a load reads it, and which parts of each step the directory holds.

Each part store is opened inside the held directory without following a link (rule 11): a
``rank_3`` that is a link (to another run, a system folder) or a FIFO is reported and skipped,
never followed nor opened. A copy counts as a part of a step only where the memory tier's recovery
takes it: intact, and its manifest names the rank of the store it is in (``memory.part``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import typer
from rich.text import Text

from crashsafe.cli._common import (
    age,
    console,
    emit_json,
    err,
    fail,
    human_bytes,
    leftover_line,
    part_rank,
    progress_bar,
    report_json,
)
from crashsafe.cli._tables import Cell, Column, print_table
from crashsafe.errors import CrashsafeError
from crashsafe.memory_tier import PART_KEY, TIMELINE_KEY
from crashsafe.storage.local import LocalStore
from crashsafe.storage.localdir import LocalDir
from crashsafe.verification import StepReport, verify_store

__all__ = ["ls_memory", "verify_memory"]

_CLAIM = re.compile(r"^(0|[1-9][0-9]*)/([1-9][0-9]*)$")


@dataclass(frozen=True)
class Copy:
    """One part store's copy of a step: how it verified and the part its manifest names."""

    store: str  # rank_<r>
    rank: int
    report: StepReport
    claims: str | None  # the manifest's memory.part, "<rank>/<world>" (None: damaged, or none)
    problem: str | None  # damaged, misplaced, or not a memory tier's part

    @property
    def world(self) -> int | None:
        """The size of the job the part is of, for a copy in its place (else None)."""
        return None if self.problem is not None or self.claims is None else int(self.claims.split("/")[1])

    def json(self) -> dict[str, Any]:
        own = {"store": self.store, "rank": self.rank, "claims": self.claims}
        return report_json(self.report) | {"ok": self.problem is None, "problem": self.problem} | own


@dataclass
class PartStore:
    """A ``rank_<r>`` entry: its copies, or why it was skipped."""

    name: str
    rank: int
    problem: str | None = None
    leftovers: list[str] = field(default_factory=list)
    spare: str | None = None  # a deleted step kept for the next save to write over (docs/memory.md)
    copies: list[Copy] = field(default_factory=list)

    def json(self) -> dict[str, Any]:
        return {"name": self.name, "rank": self.rank, "problem": self.problem, "leftovers": self.leftovers,
                "spare": self.spare}  # fmt: skip


@dataclass(frozen=True)
class MemoryStep:
    """A step as this directory holds it: the copies of its parts."""

    step: int
    copies: list[Copy]

    @property
    def worlds(self) -> list[int]:
        return sorted({w for c in self.copies if (w := c.world) is not None})

    @property
    def parts(self) -> list[int]:
        """The ranks whose part this directory holds intact, in its place."""
        return sorted(c.rank for c in self.copies if c.world is not None)

    @property
    def world(self) -> int | None:
        return self.worlds[0] if len(self.worlds) == 1 else None

    @property
    def timelines(self) -> list[str]:
        """The timelines (memory.timeline) that saved the parts held here in place: one, for one save."""
        return sorted({str(c.report.info.get(TIMELINE_KEY)) for c in self.copies if c.world is not None})

    @property
    def complete(self) -> bool:
        """Whether this directory alone holds every part of the step, all of one save."""
        return self.world is not None and self.parts == list(range(self.world)) and len(self.timelines) == 1

    @property
    def problems(self) -> list[str]:
        found = [
            f"{c.store}: {'' if c.report.ok else 'damaged: '}{c.problem}"
            for c in self.copies
            if c.problem is not None
        ]
        if len(self.worlds) > 1:
            claims = ", ".join(f"{c.store} {c.claims}" for c in self.copies if c.world is not None)
            found.append(f"its parts are of jobs of different sizes ({claims}): not one step")
        elif len(self.timelines) > 1:
            found.append(
                "its parts were saved by different timelines (a run that went back saved this step again): "
                "the memory tier's recovery takes only the parts of one save together"
            )
        return found

    def parts_text(self) -> str:
        if self.world is not None:
            return f"{','.join(map(str, self.parts))} of {self.world}"
        return ", ".join(f"{c.rank} of {c.world}" for c in self.copies if c.world is not None) or "-"

    def json(self) -> dict[str, Any]:
        created = [c.report.created for c in self.copies if c.report.created is not None]
        return {
            "step": self.step,
            "world": self.world,
            "parts": self.parts,
            "complete": self.complete,
            "ok": not self.problems,
            "problems": self.problems,
            "stored_bytes": sum(c.report.stored_bytes for c in self.copies),
            "created": max(created, default=None),
            "copies": [c.json() for c in self.copies],
        }


def _copy(part: PartStore, report: StepReport) -> Copy:
    """``report`` of ``part``'s copy of a step, judged as recovery judges it (recovery._holdings)."""
    if not report.ok:
        return Copy(part.name, part.rank, report, None, report.problem)
    claims = report.info.get(PART_KEY)
    match = _CLAIM.match(claims) if isinstance(claims, str) else None
    problem = None
    if match is None or int(match.group(1)) >= int(match.group(2)):
        problem = (
            f"not a part of a memory tier's step: its manifest's info has no {PART_KEY} of the form "
            f"<rank>/<world> ({PART_KEY}={claims!r}); the memory tier's recovery never takes it"
        )
    elif int(match.group(1)) != part.rank:
        problem = (
            f"misplaced: its manifest says it is part {claims} (rank {match.group(1)}'s), but it is in "
            f"{part.name}; the memory tier's recovery never takes it (a foreign or moved part)"
        )
    return Copy(part.name, part.rank, report, claims if isinstance(claims, str) else None, problem)


def scan(location: str, names: list[str]) -> list[PartStore]:
    """Every part store ``names`` of the memory directory ``location``, each step verified (one
    progress bar over all of them); a part store that cannot be opened safely is skipped, said why."""
    try:
        root = LocalDir.open(location)
    except OSError as exc:
        raise fail(f"cannot open the memory directory {location}: {exc.strerror}") from None
    parts: list[PartStore] = []
    with root, contextlib.ExitStack() as stack:
        opened: list[tuple[PartStore, LocalStore, list[int]]] = []
        for name in names:
            part = PartStore(name, part_rank(name) or 0)
            parts.append(part)
            try:
                store = stack.enter_context(contextlib.closing(LocalStore.inside(root, name)))
                opened.append((part, store, store.steps()))
            except CrashsafeError as exc:  # a link, a FIFO, a file: never followed nor opened
                part.problem = str(exc)
            except OSError as exc:
                part.problem = f"cannot open {location}/{name}: {exc.strerror}"
        total = sum(len(steps) for _, _, steps in opened)
        with progress_bar(f"verifying {location}", "{task.completed}/{task.total} steps") as progress:
            task = progress.add_task("verify", total=total)
            tick: Callable[[StepReport], None] = lambda _: progress.advance(task)  # noqa: E731
            for part, store, steps in opened:
                try:
                    report = verify_store(store, tick, steps)
                except (CrashsafeError, OSError) as exc:
                    part.problem = f"could not be read: {exc}"
                    continue
                part.spare = store.spare()
                part.leftovers = [name for name in report.leftovers if name != part.spare]
                part.copies = [_copy(part, r) for r in report.steps]
    return parts


def _steps(parts: list[PartStore]) -> list[MemoryStep]:
    by_step: dict[int, list[Copy]] = {}
    for part in parts:
        for copy in part.copies:
            by_step.setdefault(copy.report.step, []).append(copy)
    return [MemoryStep(step, copies) for step, copies in sorted(by_step.items())]


def ls_memory(location: str, names: list[str], as_json: bool) -> None:
    """``crashsafe ls`` of a memory directory: each step's parts held here, bytes, age, status."""
    parts = scan(location, names)
    steps = _steps(parts)
    if as_json:
        emit_json(
            {"location": location, "stores": [p.json() for p in parts], "steps": [s.json() for s in steps]}
        )
        return
    if not steps:
        console.print(Text(f"no committed step in the memory tier at {location} ({', '.join(names)})"))
    else:
        columns = [
            Column("step", right=True),
            Column("parts"),
            Column("here"),
            Column("stored", right=True, drop=2),
            Column("age", right=True, drop=1),
            Column("status", folds=True, min_width=32),
        ]
        rows: list[list[Cell]] = []
        for s in steps:
            created = s.json()["created"]
            problems = s.problems
            status = Text("ok", style="green") if not problems else Text("; ".join(problems), style="red")
            stored = human_bytes(sum(c.report.stored_bytes for c in s.copies))
            rows.append([str(s.step), s.parts_text(), "complete" if s.complete else "partial", stored,
                         age(created), status])  # fmt: skip
        print_table(f"{location} (a memory tier: {len(parts)} part stores)", columns, rows)
    _skipped(parts)


def _skipped(parts: list[PartStore]) -> None:
    for part in parts:
        if part.problem is not None:
            console.print(Text.assemble(("skipped", "yellow"), f" {part.name}: {part.problem}"))
        for name in part.leftovers:
            console.print(leftover_line(name, f"{part.name}/"))


def verify_memory(location: str, names: list[str], as_json: bool) -> None:
    """``crashsafe verify`` of a memory directory: every part store's steps, each checksum; exit 1
    on a damaged, misplaced or foreign copy, or a part store that had to be skipped."""
    parts = scan(location, names)
    copies = [c for p in parts for c in p.copies]
    bad = [c for c in copies if c.problem is not None]
    skipped = [p for p in parts if p.problem is not None]
    if as_json:
        emit_json(
            {
                "location": location,
                "ok": not bad and not skipped,
                "stores": [p.json() for p in parts],
                "steps": [c.json() for c in copies],
            }
        )
    else:
        for c in copies:
            if c.problem is None:
                console.print(Text.assemble(("ok", "green"), f"      {c.store} step {c.report.step}  part "
                                            f"{c.claims}  {human_bytes(c.report.stored_bytes)}"))  # fmt: skip
            else:
                label = "DAMAGED" if not c.report.ok else "PROBLEM"
                console.print(Text.assemble((label, "red"), f" {c.store} step {c.report.step}: {c.problem}"))
        _skipped(parts)
    if bad or skipped:
        what = [f"{len(bad)} of {len(copies)} part steps damaged, misplaced or foreign"] if bad else []
        what += [f"{len(skipped)} of {len(parts)} part stores skipped"] if skipped else []
        err.print(
            Text.assemble(
                ("; ".join(what), "bold red"),
                f"; the memory tier's recovery passes over them (a peer's copy, an older complete step or "
                f"the persistent tier instead). `crashsafe ls {location}` shows which steps are complete",
            )
        )
        raise typer.Exit(1)
    if not as_json:
        if copies:
            console.print(
                Text(f"all {len(copies)} part steps intact, in {len(parts)} part stores", "bold green")
            )
        else:
            console.print(Text(f"no committed step in the memory tier at {location}: nothing to verify"))
