"""Check every committed step of a directory: manifest, file sizes and every payload checksum."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from crashsafe.chain import direct_bases
from crashsafe.errors import CorruptCheckpointError, NoCheckpointError
from crashsafe.storage.layout import committed_steps, leftovers, step_dir
from crashsafe.storage.reader import StepReader

__all__ = ["StepReport", "VerifyReport", "verify", "verify_step", "with_chains"]


@dataclass(frozen=True)
class StepReport:
    """Verification result of one committed step."""

    step: int
    ok: bool
    problem: str | None = None
    raw_bytes: int = 0
    stored_bytes: int = 0
    created: float | None = None
    bases: frozenset[int] = frozenset()  # earlier steps its delta payloads need


@dataclass(frozen=True)
class VerifyReport:
    """Verification result of a checkpoint directory."""

    directory: Path
    steps: list[StepReport] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every committed step is intact (leftovers of torn saves are harmless)."""
        return all(s.ok for s in self.steps)

    @property
    def intact(self) -> list[int]:
        return [s.step for s in self.steps if s.ok]

    @property
    def damaged(self) -> list[StepReport]:
        return [s for s in self.steps if not s.ok]


def verify_step(root: Path, step: int) -> StepReport:
    """Read one step completely and check every checksum."""
    try:
        with StepReader(root, step) as reader:
            reader.verify()
            m = reader.manifest
            return StepReport(step, True, None, m.raw_nbytes, m.stored_nbytes, m.created, direct_bases(m))
    except CorruptCheckpointError as exc:
        return StepReport(step, False, str(exc), stored_bytes=_du(step_dir(root, step)))
    except NoCheckpointError as exc:
        return StepReport(step, False, str(exc))
    except OSError as exc:
        return StepReport(step, False, f"cannot read step {step}: {exc}")


def verify(
    directory: str | os.PathLike[str], progress: Callable[[StepReport], None] | None = None
) -> VerifyReport:
    """Verify every committed step under ``directory``; ``progress`` is called after each."""
    root = Path(directory)
    if not root.is_dir():
        raise NoCheckpointError(f"{root} is not a directory")
    reports = []
    for step in committed_steps(root):
        report = verify_step(root, step)
        reports.append(report)
        if progress is not None:
            progress(report)
    return VerifyReport(root, with_chains(reports), [p.name for p in leftovers(root)])


def with_chains(reports: list[StepReport]) -> list[StepReport]:
    """Mark a step damaged when a delta base it needs is missing or damaged (reports ascending)."""
    status: dict[int, StepReport] = {}
    out = []
    for report in reports:
        broken = sorted(b for b in report.bases if b not in status or not status[b].ok)
        if report.ok and broken:
            report = dataclasses.replace(
                report,
                ok=False,
                problem=f"step {report.step} is a delta of step {broken[0]}, which is "
                f"{'damaged' if broken[0] in status else 'missing'}; restore falls back to an older step",
            )
        status[report.step] = report
        out.append(report)
    return out


def _du(path: Path) -> int:
    try:
        return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
    except OSError:
        return 0
