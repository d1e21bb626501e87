"""Check committed steps the way a load reads them: manifest, files, checksums and decoding.

Verification decodes every payload through its delta chain and references, exactly as ``load``
does, so a step reported intact is a step that loads: bytes a step refers to are checked as the
bytes of the step holding them (once per pass, however many steps refer to them; a pass remembers
the steps it verified whole, not each of their payloads). It streams: one
payload is decoded at a time (raw payloads are checksummed through a small buffer without being
held), and consecutive steps share the reconstruction of each delta-coded path so every chain link
is decoded once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from crashsafe.chain import ChainReader, direct_bases
from crashsafe.distributed.shards import check_shards
from crashsafe.errors import CorruptCheckpointError, NoCheckpointError
from crashsafe.storage.base import Store
from crashsafe.storage.stores import open_store

__all__ = ["StepReport", "VerifyReport", "verify", "verify_store"]


@dataclass(frozen=True)
class StepReport:
    """Verification result of one committed step."""

    step: int
    ok: bool
    problem: str | None = None
    raw_bytes: int = 0
    stored_bytes: int = 0
    created: float | None = None
    bases: frozenset[int] = frozenset()  # earlier steps it needs: delta bases and the steps it refers to
    metrics: dict[str, Any] = field(default_factory=dict)  # what the step was saved with
    saved_as: str | None = None  # a Lightning checkpoint's file name (Manifest.saved_as)
    references: frozenset[int] = frozenset()  # earlier steps whose bytes its references are
    referenced_bytes: int = 0  # stored bytes of its references (held by those steps, not in stored_bytes)
    info: dict[str, Any] = field(default_factory=dict)  # the manifest's info ({} for a damaged step)


@dataclass(frozen=True)
class VerifyReport:
    """Verification result of a checkpoint directory."""

    directory: str
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


def verify(
    directory: str | os.PathLike[str],
    progress: Callable[[StepReport], None] | None = None,
    steps: Sequence[int] | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> VerifyReport:
    """Verify the committed steps at ``directory`` (a path or an object-store URL), or just
    ``steps``, oldest first.

    ``progress`` is called with each step's report as it is done. A step deleted by a concurrent
    writer's retention while it is verified is left out of the report.
    """
    store = open_store(directory, storage_options=storage_options, existing=True)
    try:
        return verify_store(store, progress, steps)
    finally:
        store.close()


def verify_store(
    store: Store, progress: Callable[[StepReport], None] | None = None, steps: Sequence[int] | None = None
) -> VerifyReport:
    """:func:`verify` of a store already open (left open): the CLI opens each part of a memory
    tier without following a link, then verifies it."""
    with ChainReader(store, keep_references=True) as chains:
        reports = []
        for step in sorted(store.steps() if steps is None else steps):
            report = _verify_step(chains, step)
            if report is None:
                continue
            reports.append(report)
            if progress is not None:
                progress(report)
        return VerifyReport(store.location, reports, store.leftovers())


def _verify_step(chains: ChainReader, step: int) -> StepReport | None:
    try:
        for _ in chains.payloads(step, verify_only=True):
            pass
        m = chains.manifest(step)
        check_shards(m)  # as every load of a sharded array does
        bases = direct_bases(m)
        sizes = (m.raw_nbytes, m.stored_nbytes, m.created)
        return StepReport(
            step, True, None, *sizes, bases, m.metrics, m.saved_as, m.references, m.referenced_nbytes, m.info
        )
    except CorruptCheckpointError as exc:
        return StepReport(step, False, str(exc), stored_bytes=chains.store.stored_bytes(step))
    except NoCheckpointError:
        return None  # deleted while we looked
