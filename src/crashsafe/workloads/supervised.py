"""The trainer's side of a kill-and-resume run: deterministic start-up, then train and log events.

The demo's trainer (``python -m crashsafe.workloads.digits``) and the field test's
(``crashsafe.sim.fieldtrainer``) differ only in their manager and state: both call
:func:`deterministic_torch`, then :func:`train_logged`, which writes the events their supervisor
follows (:mod:`crashsafe.workloads.eventlog`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from crashsafe.workloads.eventlog import EventLog

if TYPE_CHECKING:
    from crashsafe.manager import CheckpointManager

__all__ = ["Trainer", "deterministic_torch", "train_logged"]


class Trainer(Protocol):
    """A training job as :func:`train_logged` drives it; ``state`` is what a checkpoint holds."""

    state: dict[str, Any]

    @property
    def step(self) -> int: ...

    def train_step(self) -> float:
        """One optimizer step; advances ``state["step"]`` and returns the loss."""
        ...


def deterministic_torch() -> None:
    """One thread and deterministic kernels, so a resumed run continues bit-identically."""
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def train_logged(
    trainer: Trainer,
    manager: CheckpointManager,
    log: Path,
    steps: int,
    *,
    spawned: float,
    save_every: int = 1,
    done: Callable[[], dict[str, Any]] | None = None,
) -> None:
    """Restore ``trainer.state`` through ``manager``, train to ``steps`` offering a save every
    ``save_every`` steps (and at the last), and log each start, step, commit and the end to ``log``.

    ``spawned`` is the wall time the process started (its recovery time counts from there); ``done``
    adds fields to the final event, e.g. the held-out accuracy.
    """
    with closing(EventLog(log)) as events:
        restore_began = time.perf_counter()
        restored = manager.restore(trainer.state)
        events.emit(
            "start",
            resumed_from=restored,
            spawned=spawned,
            recovery_s=time.time() - spawned,
            restore_s=time.perf_counter() - restore_began,
        )
        reported = 0

        def report_commits() -> None:
            nonlocal reported
            for s in manager.stats[reported:]:
                events.emit(
                    "committed",
                    step=s.step,
                    stall=s.stall,
                    setup=s.setup,
                    persist=s.persist,
                    stored_bytes=s.stored_bytes,
                    raw_bytes=s.raw_bytes,
                )
            reported = len(manager.stats)

        while trainer.step < steps:
            loss = trainer.train_step()
            events.emit("step", step=trainer.step, loss=loss)
            if trainer.step % save_every == 0 or trainer.step == steps:
                manager.maybe_save(trainer.step, trainer.state, metrics={"loss": loss})
            report_commits()
        manager.wait()
        report_commits()
        events.emit("done", step=trainer.step, **(done() if done is not None else {}))
