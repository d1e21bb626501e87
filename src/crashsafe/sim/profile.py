"""A training job as the simulator sees it: loss curve, step time and fault-tolerance costs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from crashsafe._units import UnitError, parse_duration
from crashsafe.sim.curve import LossCurve
from crashsafe.sim.errors import SimulationError

__all__ = ["Profile"]


def _seconds(value: float | str, name: str) -> float:
    try:
        seconds = parse_duration(value, name)
    except UnitError as exc:
        raise SimulationError(str(exc)) from None
    if not math.isfinite(seconds):
        raise SimulationError(f"{name} must be finite, got {value!r}")
    return seconds


@dataclass(frozen=True)
class Profile:
    """Seconds per step, the training stall of a checkpoint, its background persist time (the
    checkpoint protects nothing until persisted) and the restart time after a failure."""

    curve: LossCurve
    step_time: float
    stall: float = 0.0
    persist: float = 0.0
    restart: float = 0.0

    def __post_init__(self) -> None:
        for name in ("step_time", "stall", "persist", "restart"):
            object.__setattr__(self, name, _seconds(getattr(self, name), name))
        if self.step_time <= 0:
            raise SimulationError(f"step_time must be positive, got {self.step_time!r}")

    @classmethod
    def make(
        cls,
        curve: LossCurve,
        step_time: float | str,
        stall: float | str = 0.0,
        persist: float | str = 0.0,
        restart: float | str = 0.0,
    ) -> Profile:
        """Like the constructor, with durations such as ``"30s"``."""
        return cls(curve, step_time, stall, persist, restart)  # type: ignore[arg-type]
