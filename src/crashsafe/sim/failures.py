"""Failure processes: time between failures, in wall-clock seconds, for many trials at once.

Each model fills a (trials × width) block of inter-failure times starting at column ``start``; a
block depends only on (seed, start), so every policy replayed with the same seed meets exactly the
same failures (paired comparisons). After a failure the process renews (a fresh node or process).
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from crashsafe._units import UnitError, parse_duration
from crashsafe.sim.curve import read_text_file
from crashsafe.sim.errors import SimulationError

__all__ = ["Exponential", "FailureModel", "Trace", "Weibull"]


class FailureModel(Protocol):
    """Inter-failure times for a simulation."""

    @property
    def mtbf(self) -> float: ...

    def block(self, seed: int, trials: int, start: int, width: int) -> np.ndarray: ...


def _mtbf(value: float | str) -> float:
    try:
        seconds = parse_duration(value, "mtbf")
    except UnitError as exc:
        raise SimulationError(str(exc)) from None
    if seconds <= 0:
        raise SimulationError(f"mtbf must be positive, got {value!r}")
    return seconds


@dataclass(frozen=True)
class _Renewal(ABC):
    """Independent, identically distributed times between failures with mean ``mean`` (a duration)."""

    mean: float | str

    @property
    def mtbf(self) -> float:
        return _mtbf(self.mean)

    def block(self, seed: int, trials: int, start: int, width: int) -> np.ndarray:
        if math.isinf(self.mtbf):
            return np.full((trials, width), math.inf)
        return self._draw(np.random.default_rng((seed, start)), (trials, width))

    @abstractmethod
    def _draw(self, rng: np.random.Generator, size: tuple[int, int]) -> np.ndarray:
        """``size`` times between failures of mean ``self.mtbf`` (finite)."""


@dataclass(frozen=True)
class Exponential(_Renewal):
    """Poisson failures: exponential times between failures with mean ``mtbf`` (``inf``: never)."""

    def _draw(self, rng: np.random.Generator, size: tuple[int, int]) -> np.ndarray:
        return rng.exponential(self.mtbf, size)


@dataclass(frozen=True)
class Weibull(_Renewal):
    """Weibull times between failures with mean ``mtbf``; ``shape`` < 1 means infant mortality."""

    shape: float = 0.7

    def __post_init__(self) -> None:
        if not (self.shape > 0 and math.isfinite(self.shape)):
            raise SimulationError(f"Weibull shape must be positive, got {self.shape!r}")

    def _draw(self, rng: np.random.Generator, size: tuple[int, int]) -> np.ndarray:
        scale = self.mtbf / math.gamma(1.0 + 1.0 / self.shape)
        return scale * rng.weibull(self.shape, size)


@dataclass(frozen=True)
class Trace:
    """Failures replayed from a recorded trace of failure times (seconds since the trace began).

    With ``randomize`` each trial starts at a random failure of the trace, a random fraction into its
    gap, and cycles; without it every trial sees the trace exactly from its start (a single replay).
    """

    times: tuple[float, ...]
    randomize: bool = True

    def __post_init__(self) -> None:
        times = np.asarray(self.times, dtype=np.float64)
        if times.ndim != 1 or times.size < 1 or not np.all(np.isfinite(times)):
            raise SimulationError("a failure trace needs at least one finite failure time")
        if times[0] < 0 or np.any(np.diff(times) <= 0):
            raise SimulationError("failure times must be >= 0 and strictly increasing")

    @property
    def gaps(self) -> np.ndarray:
        times = np.asarray(self.times, dtype=np.float64)
        return np.diff(np.concatenate([[0.0], times]))

    @property
    def mtbf(self) -> float:
        return float(self.gaps.mean())

    def block(self, seed: int, trials: int, start: int, width: int) -> np.ndarray:
        gaps = self.gaps
        if not self.randomize:
            index = np.arange(start, start + width)
            row = np.where(index < gaps.size, gaps[np.minimum(index, gaps.size - 1)], math.inf)
            fixed: np.ndarray = np.tile(row, (trials, 1))
            return fixed
        rng = np.random.default_rng((seed, 0x7ACE))
        offsets, phase = rng.integers(0, gaps.size, trials), rng.random(trials)
        out: np.ndarray = gaps[(offsets[:, None] + np.arange(start, start + width)[None, :]) % gaps.size]
        if start == 0:
            out[:, 0] *= phase  # the first failure comes a random part of the way into its gap
        return out

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], randomize: bool = True) -> Trace:
        """One failure time per line (first comma-separated field; seconds or '3h'); '#' comments."""
        path = Path(path)
        lines = read_text_file(path, "failure trace").splitlines()
        times = []
        for number, line in enumerate(lines, start=1):
            field = line.split("#", 1)[0].split(",", 1)[0].strip()
            if not field or (number == 1 and field.lower() in ("time", "t", "failure")):
                continue
            try:
                times.append(parse_duration(field, f"{path.name}:{number}"))
            except UnitError as exc:
                raise SimulationError(str(exc)) from None
        return cls(tuple(times), randomize)
