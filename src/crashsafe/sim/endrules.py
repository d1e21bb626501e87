"""When a simulated job ends: after fixed steps, at a target loss, or early at a plateau (COCI's
exploratory jobs, stopped once training stops paying off). Rules look at the smoothed curve."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from crashsafe.sim.curve import LossCurve
from crashsafe.sim.errors import SimulationError

__all__ = ["EndRule", "FixedSteps", "Plateau", "TargetLoss"]


class EndRule(Protocol):
    """The step at which the failure-free job ends."""

    def end_step(self, curve: LossCurve) -> int: ...


@dataclass(frozen=True)
class FixedSteps:
    """Run ``steps`` steps (default: the whole curve)."""

    steps: int | None = None

    def end_step(self, curve: LossCurve) -> int:
        steps = curve.steps if self.steps is None else self.steps
        if not 1 <= steps <= curve.steps:
            raise SimulationError(
                f"FixedSteps({steps}) needs 1..{curve.steps} steps (the curve's length); "
                "resample the curve for a longer job"
            )
        return steps


@dataclass(frozen=True)
class TargetLoss:
    """Stop at the first step whose smoothed loss is at or below ``loss``."""

    loss: float

    def end_step(self, curve: LossCurve) -> int:
        reached = np.flatnonzero(curve.smooth <= self.loss)
        if reached.size == 0:
            raise SimulationError(
                f"the curve never reaches the target loss {self.loss:g} (its smoothed minimum is "
                f"{curve.smooth[-1]:.4g}); choose a higher target"
            )
        return int(reached[0]) + 1


@dataclass(frozen=True)
class Plateau:
    """Exploratory early stop: end once the smoothed loss fell by less than ``min_drop`` (relative)
    over the last ``window`` (a fraction of the recorded run); the whole run if it never does."""

    window: float = 0.1
    min_drop: float = 0.05

    def __post_init__(self) -> None:
        if not (0 < self.window < 1 and 0 <= self.min_drop < 1):
            raise SimulationError(f"Plateau needs 0 < window < 1 and 0 <= min_drop < 1, got {self}")

    def end_step(self, curve: LossCurve) -> int:
        lag = max(1, round(self.window * curve.steps))
        smooth = curve.smooth
        earlier, later = smooth[:-lag], smooth[lag:]
        stalled = np.flatnonzero(earlier - later < self.min_drop * earlier)
        return int(stalled[0]) + lag + 1 if stalled.size else curve.steps
