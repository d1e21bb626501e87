"""A save policy that knows the future loss curve: the ceiling for any convergence-aware schedule.

An online policy must estimate how fast the loss falls now (r) against the job's mean rate over its
whole run (ρ). ``Hindsight`` is handed both from the recorded curve and the job's end, and places
checkpoints by the value-optimal rule τ(t) = τ_Daly·√((1 + μ)/(r(t)/ρ + μ)). With μ = 0 it minimises
checkpoint stalls plus the expected progress that failures roll back (priced at ρ); a larger μ trades
some of that for wall time (μ → ∞ is Daly). The benchmark uses it to show how far any schedule
could beat Young, so an unmet target can be told apart from a weak policy.
"""

from __future__ import annotations

import math

import numpy as np

from crashsafe.policies.base import SaveContext
from crashsafe.policies.measured import check_mtbf
from crashsafe.policies.young_daly import daly_interval
from crashsafe.sim.endrules import EndRule, FixedSteps
from crashsafe.sim.errors import SimulationError
from crashsafe.sim.profile import Profile

__all__ = ["Hindsight"]


class Hindsight:
    """The value schedule computed from the true curve of ``profile`` up to the job's ``end``.

    Args:
        profile: the job (curve, step time, checkpoint stall = the cost the schedule assumes).
        mtbf: mean time between failures (seconds or ``"4h"``).
        end: the job's end rule (default: the whole curve); ρ is the mean rate up to it.
        mu: 0 minimises lost value alone; larger values stay closer to Daly's wall-time optimum.
        dense, stretch: intervals stay within [τ_Daly/dense, τ_Daly·stretch].
        window: the rate is averaged over this fraction of the job (a step-to-step rate is noise).
    """

    def __init__(
        self,
        profile: Profile,
        mtbf: float | str,
        end: EndRule | None = None,
        *,
        mu: float = 0.0,
        dense: float = 16.0,
        stretch: float = 8.0,
        window: float = 0.005,
    ) -> None:
        for name, value, low in (("mu", mu, 0.0), ("dense", dense, 1.0), ("stretch", stretch, 1.0)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= low):
                raise SimulationError(f"{name} must be a finite number >= {low:g}, got {value!r}")
        if not 0 < window < 1:
            raise SimulationError(f"window must be a fraction in (0, 1), got {window!r}")
        self.mtbf = check_mtbf(mtbf)
        self.mu, self.dense, self.stretch = float(mu), float(dense), float(stretch)
        self.step_time = profile.step_time
        self.base = daly_interval(max(profile.stall, 1e-9), self.mtbf)  # inf when failures never come
        end_step = (end or FixedSteps()).end_step(profile.curve)
        smooth = profile.curve.smooth[:end_step]
        rate = np.maximum(-np.diff(np.concatenate([[smooth[0]], smooth])), 0.0)
        width = max(1, round(window * end_step))
        rate = np.convolve(rate, np.ones(width) / width, mode="same")
        mean = float(rate.mean())
        self.relative_rate = rate / mean if mean > 0 else np.ones_like(rate)

    def factor(self, step: int) -> float:
        """τ/τ_Daly for an interval starting after ``step`` steps."""
        x = float(self.relative_rate[min(max(step, 0), self.relative_rate.size - 1)])
        raw = math.sqrt((1 + self.mu) / (x + self.mu)) if self.mu > 0 or x > 0 else math.inf
        return min(self.stretch, max(1.0 / self.dense, raw))

    def should_save(self, context: SaveContext) -> bool:
        last = context.last_save_train_time or 0.0
        return context.train_time - last >= self.base * self.factor(round(last / self.step_time))

    def __repr__(self) -> str:
        return f"Hindsight(mtbf={self.mtbf:g}, mu={self.mu:g})"
