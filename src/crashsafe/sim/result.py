"""Summaries of simulated trials with 95% confidence intervals, and paired ratios between policies."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from crashsafe.sim.engine import Outcomes

__all__ = ["METRICS", "Estimate", "SimResult", "paired_ratio"]

METRICS = {
    "overhead": "fault-tolerance overhead, s (stalls + lost work + restarts)",
    "weighted": "progress-weighted overhead, s (stalls + restarts + lost loss decrease / mean rate)",
    "wall": "time to the end rule (e.g. target loss), s",
    "stalls": "checkpoint stalls, s",
    "lost_work": "training redone after rollbacks, s",
    "restarts": "restart time, s",
    "progress_lost": "loss decrease rolled back by failures",
    "failures": "failures per job",
}


@dataclass(frozen=True)
class Estimate:
    """Mean with a 95% normal confidence interval over the trials."""

    mean: float
    low: float
    high: float

    @classmethod
    def of(cls, values: np.ndarray) -> Estimate:
        values = values[np.isfinite(values)]
        if values.size == 0:
            return cls(math.nan, math.nan, math.nan)
        mean = float(values.mean())
        half = 1.96 * float(values.std(ddof=1)) / math.sqrt(values.size) if values.size > 1 else 0.0
        return cls(mean, mean - half, mean + half)

    def __format__(self, spec: str) -> str:
        spec = spec or ".4g"
        return f"{self.mean:{spec}} [{self.low:{spec}}, {self.high:{spec}}]"


@dataclass(frozen=True)
class SimResult:
    """One policy on one profile: its failure-free schedule and the per-trial outcomes."""

    policy: str
    checkpoint_steps: np.ndarray
    end_step: int
    outcomes: Outcomes
    notes: tuple[str, ...] = ()

    def values(self, metric: str) -> np.ndarray:
        """Per-trial values of ``metric`` (see :data:`METRICS`); NaN for trials that never finished."""
        o = self.outcomes
        if metric == "overhead":
            values = o.wall - o.compute
        elif metric == "weighted":
            scale = 1.0 / o.mean_rate if o.mean_rate > 0 else math.inf
            values = o.stalls + o.restarts + o.progress_lost * scale
        elif metric in ("wall", "stalls", "lost_work", "restarts", "progress_lost", "failures"):
            values = getattr(o, metric)
        else:
            raise KeyError(f"unknown metric {metric!r}; choose from {', '.join(METRICS)}")
        return np.where(o.finished, values, np.nan)

    def estimate(self, metric: str) -> Estimate:
        return Estimate.of(self.values(metric))

    @property
    def unfinished(self) -> int:
        return int((~self.outcomes.finished).sum())

    @property
    def trials(self) -> int:
        return int(self.outcomes.finished.size)


def paired_ratio(a: SimResult, b: SimResult, metric: str, resamples: int = 400, seed: int = 0) -> Estimate:
    """mean(a)/mean(b) of ``metric`` with a paired bootstrap 95% interval (same failures per trial)."""
    x, y = a.values(metric), b.values(metric)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    if x.size == 0 or y.sum() == 0:
        return Estimate(math.nan, math.nan, math.nan)
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, x.size, (resamples, x.size))
    boot = x[pick].mean(axis=1) / np.maximum(y[pick].mean(axis=1), 1e-300)
    low, high = np.percentile(boot, [2.5, 97.5])
    return Estimate(float(x.mean() / y.mean()), float(low), float(high))
