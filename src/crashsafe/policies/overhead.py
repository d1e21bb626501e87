"""CheckFreq-style cap: never let checkpoint stalls exceed a fraction of the training time."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from crashsafe.policies.base import SaveContext
from crashsafe.policies.errors import PolicyError
from crashsafe.policies.measured import CostClock

__all__ = ["MaxOverhead"]


class MaxOverhead:
    """Save only when the stall of a save would stay within ``fraction`` of the time since the last.

    With measured cost δ, a save is allowed once δ/(Δ + δ) ≤ fraction, i.e. after Δ ≥ δ·(1 − f)/f
    seconds of training. Alone it saves as often as that allows (CheckFreq's 5% rule, adapted to the
    measured cost as it changes); as a cap, combine it: ``AllOf(Young("4h"), MaxOverhead(0.05))``.
    Other arguments as for :class:`~crashsafe.policies.Young`.
    """

    def __init__(
        self,
        fraction: float,
        *,
        cost: float | str | None = None,
        include_persist: bool = False,
        profile_step: int = 10,
    ) -> None:
        if not (isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
                and math.isfinite(fraction) and 0 < fraction < 1):
            raise PolicyError(f"MaxOverhead fraction must be in (0, 1), e.g. 0.05 for 5%, got {fraction!r}")
        self.fraction = float(fraction)
        self.clock = CostClock(cost, include_persist, profile_step)

    def min_interval(self, cost: float) -> float:
        """Training seconds that must pass between saves costing ``cost`` seconds."""
        return cost * (1.0 - self.fraction) / self.fraction

    def should_save(self, context: SaveContext) -> bool:
        now = self.clock.observe(context)
        cost = self.clock.cost()
        if cost is None:
            return self.clock.profile_due(context)
        return now - self.clock.last_save(context) >= self.min_interval(cost)

    def state_dict(self) -> dict[str, Any]:
        """Clock and measured cost (see :class:`~crashsafe.policies.Young`)."""
        return self.clock.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.clock.load_state_dict(state)

    def __repr__(self) -> str:
        return f"MaxOverhead({self.fraction:g})"
