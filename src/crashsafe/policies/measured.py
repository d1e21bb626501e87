"""Bookkeeping shared by the cost-driven policies: a clock that survives restarts, the measured cost,
and the profiling save that measures it when nothing is known yet.

The manager's ``train_time`` restarts at zero in a new process. A policy that is part of the saved
state (``state = {..., "policy": policy}``) gets its clock and measured cost back on restore, so the
schedule continues where the checkpoint left it (as COCI's ``recovery()`` shifts its start time).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from crashsafe.policies.base import SaveContext
from crashsafe.policies.errors import PolicyError
from crashsafe.policies.units import parse_duration

__all__ = ["CostClock", "check_mtbf"]


def check_mtbf(mtbf: float | str) -> float:
    """MTBF in seconds; must be positive (``inf`` means failures never happen)."""
    seconds = parse_duration(mtbf, "mtbf")
    if seconds <= 0:
        raise PolicyError(f"mtbf must be positive (mean time between failures), got {mtbf!r}")
    return seconds


class CostClock:
    """Policy clock (training seconds since the job began, across restarts) and checkpoint cost.

    Args:
        cost: fixed checkpoint cost in seconds (COCI's MANUAL mode); None measures it (AUTO mode).
        include_persist: count the background persist time in the cost (for synchronous saves).
        profile_step: with no cost known, take one profiling save at the ``profile_step``-th call (COCI:
            iteration 10), counted from the start or the restore.
    """

    def __init__(self, cost: float | str | None, include_persist: bool, profile_step: int) -> None:
        self.fixed_cost = None if cost is None else parse_duration(cost, "cost")
        if isinstance(profile_step, bool) or not isinstance(profile_step, int) or profile_step < 0:
            raise PolicyError(f"profile_step must be an int >= 0, got {profile_step!r}")
        self.include_persist = bool(include_persist)
        self.profile_step = profile_step
        self.known_cost: float | None = None
        self.offset = 0.0
        self.base: float | None = 0.0
        self.origin_step: int | None = None
        self.calls = 0
        self.now = 0.0

    def observe(self, context: SaveContext) -> float:
        """Record this call; return the policy clock (seconds of training since the job began)."""
        if self.base is None:  # first call after a restore
            self.base = context.train_time
        if self.origin_step is None:
            self.origin_step = context.step
        self.calls += 1
        self.now = self.offset + context.train_time - self.base
        measured = self._measured(context)
        if measured is not None:
            self.known_cost = measured
        return self.now

    def _measured(self, context: SaveContext) -> float | None:
        if context.stall is None or not math.isfinite(context.stall):
            return None
        persist = context.persist if context.persist is not None and math.isfinite(context.persist) else 0.0
        return max(0.0, context.stall + (persist if self.include_persist else 0.0))

    def cost(self) -> float | None:
        """The checkpoint cost to plan with: fixed, else the latest measurement, else None."""
        return self.fixed_cost if self.fixed_cost is not None else self.known_cost

    def last_save(self, context: SaveContext) -> float:
        """Policy-clock time of the newest save (else of the restored checkpoint, or 0: the start)."""
        if context.last_save_train_time is not None and self.base is not None:
            return self.offset + context.last_save_train_time - self.base
        return self.offset

    def profile_due(self, context: SaveContext) -> bool:
        """True once, to take the save that measures the cost, when no cost is known yet."""
        if self.cost() is not None or context.last_save_step is not None:
            return False
        return self.calls >= self.profile_step

    def state_dict(self) -> dict[str, Any]:
        return {"clock": self.now, "cost": self.known_cost}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        clock, cost = state.get("clock"), state.get("cost")
        if not isinstance(clock, (int, float)) or not math.isfinite(clock) or clock < 0:
            raise PolicyError(f"saved policy clock must be a non-negative number, got {clock!r}")
        self.offset, self.base, self.origin_step, self.calls = float(clock), None, None, 0
        self.now = self.offset
        if isinstance(cost, (int, float)) and math.isfinite(cost) and cost >= 0:
            self.known_cost = float(cost)
