"""What a save policy decides on, as a manager measures it: training time (wall time less the time
saves stalled training), the last save, and the measured cost of recent saves: the stall each
would pay again, without the one-time allocation of staging buffers (a first save's stall was
mostly that: 40 times a later one's, which made a cost-based policy's first intervals after every
start several times too long)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from crashsafe.policies.base import SaveContext
from crashsafe.saving import SaveStats

__all__ = ["Pacing"]


class Pacing:
    """A manager's clock of training time and of its saves."""

    def __init__(self) -> None:
        self._started = time.perf_counter()
        self._stalled = 0.0
        self.last_save: tuple[int, float] | None = None  # (step, training time) of the last save

    def stalled(self, seconds: float) -> None:
        """Training waited ``seconds`` for a save: not training time."""
        self._stalled += seconds

    def saved(self, step: int) -> None:
        self.last_save = (step, self.train_time())

    def train_time(self) -> float:
        return time.perf_counter() - self._started - self._stalled

    def context(
        self, step: int, metrics: Mapping[str, Any] | None, stats: Sequence[SaveStats]
    ) -> SaveContext:
        """The facts a policy decides on at ``step``; ``stats``: the saves committed so far."""
        recent = stats[-5:]
        return SaveContext(
            step=step,
            train_time=self.train_time(),
            last_save_step=self.last_save[0] if self.last_save else None,
            last_save_train_time=self.last_save[1] if self.last_save else None,
            stall=sum(s.recurring_stall for s in recent) / len(recent) if recent else None,
            persist=sum(s.persist for s in recent) / len(recent) if recent else None,
            saves=len(stats),
            metrics=dict(metrics or {}),
        )
