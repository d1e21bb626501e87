"""Convergence-aware checkpointing (COCI, FGCS 2024): protect the fast early progress densely.

The policy profiles the checkpoint cost with one early save, fits the loss curve
L(t) = exp(θ1·t + θ2) (t = training minutes, stalls excluded) and refits it on the samples since the
last fit, every ``refit_every`` steps (COCI: 10,000) or, by default, each time the step count since the
start has grown by half (refits spaced like the curve's own time scale). Two schedules:

- ``"coci"``: COCI's published schedule, reproduced exactly: each checkpoint protects the same loss
  decrease pc = (1 − e^{θ1·ts})·(1/(2λ) − 1/(2θ1)) (minutes, per minute), at
  t_i = (ln(L_now − i·pc) − θ2)/θ1 for i = 1..⌊L_now/pc⌋, and none after the last. The schedule is
  rebuilt when a refit moves |Δθ1| or |Δθ2| by more than ``refit_threshold`` (COCI: 0.1).
- ``"value"`` (default): minimises checkpoint stalls plus the expected loss decrease that Poisson failures
  roll back, a unit of loss priced at the job's mean convergence rate ρ (loss per second). Over an
  interval τ from t a failure rolls back ≈ r(t)·τ/2 of loss decrease (r = −dL/dt), so the optimum is
  Young's with the cost scaled by ρ/r(t): τ(t) = τ_Daly·√(ρ/r(t)), kept within
  [τ_Daly/dense, τ_Daly·stretch]. ρ = (L₀ − L(H))/H over the horizon H, by default the time until the
  current fit has made 95% of its remaining progress (now + ln 20/|θ1|); L₀ is the first fit's L(0).
  Every refit is used at once (re-deriving τ costs nothing).

Fallbacks, never an exception mid-training: before the first fit, when the fit fails, when the loss is
missing or not finite, or when the fitted curve is not decreasing (COCI), the policy uses Daly's interval
and issues one :class:`PolicyWarning` naming the reason (also in ``policy.fallback``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from crashsafe._log import warn
from crashsafe.policies.base import SaveContext
from crashsafe.policies.errors import FitError, PolicyError, PolicyWarning
from crashsafe.policies.fitting import ExpFit, fit_exponential
from crashsafe.policies.measured import CostClock, check_mtbf
from crashsafe.policies.units import parse_duration
from crashsafe.policies.young_daly import daly_interval

__all__ = ["ConvergenceAware", "coci_protected_loss", "coci_schedule", "value_factor"]

Schedule = Literal["value", "coci"]
_HORIZON = math.log(20.0)  # e-folds until 95% of the remaining progress is made


def coci_protected_loss(theta1: float, ts_min: float, failure_rate_per_min: float) -> float:
    """COCI's loss decrease protected per checkpoint, verbatim: (1 − e^{θ1·ts})·(1/(2λ) − 1/(2θ1)).

    Units as in COCI's code: θ1 per minute, ts in minutes, λ per minute.
    """
    return (1.0 - math.exp(theta1 * ts_min)) * (1.0 / (2.0 * failure_rate_per_min) - 1.0 / (2.0 * theta1))


def coci_schedule(
    fit: ExpFit,
    t_now_min: float,
    ts_min: float,
    failure_rate_per_min: float,
    n_done: int = 0,
    limit: int = 1_000_000,
) -> np.ndarray:
    """COCI's checkpoint times (minutes) from ``t_now_min``, as its ``_COCI_strategy`` computes them.

    ``t_now_min`` is COCI's wall clock, which includes the ``n_done`` stalls already taken; pass
    ``n_done=0`` with a clock that excludes stalls (as this library's). Empty when θ1 ≥ 0 or pc ≤ 0;
    at most the first ``limit`` times (a tiny pc would otherwise ask for millions).
    """
    if fit.theta1 >= 0:
        return np.empty(0)
    pc = coci_protected_loss(fit.theta1, ts_min, failure_rate_per_min)
    t_run = t_now_min - n_done * ts_min
    l_now = fit.loss(t_run)
    if not (pc > 0 and math.isfinite(pc) and math.isfinite(l_now)):
        return np.empty(0)
    i = np.arange(1, min(math.floor(l_now / pc), limit) + 1)
    times: np.ndarray = (np.log(l_now - i * pc) - fit.theta2) / fit.theta1 + n_done * ts_min
    return times


def value_factor(
    fit: ExpFit, t_min: float, initial_loss: float, horizon_min: float | None, dense: float, stretch: float
) -> float:
    """τ/τ_Daly for a checkpoint at ``t_min``: √(ρ/r(t)) within [1/dense, stretch].

    ρ is the mean loss decrease per minute from ``initial_loss`` over the horizon (default: until the
    fit has made 95% of its remaining progress); a curve that no longer decreases gets ``stretch``.
    """
    rate = fit.rate(t_min)
    if not (rate > 0 and math.isfinite(rate)):
        return stretch
    horizon = t_min + _HORIZON / -fit.theta1 if horizon_min is None else horizon_min
    mean_rate = (initial_loss - fit.loss(horizon)) / horizon if horizon > 0 else 0.0
    if not mean_rate > 0:
        return stretch
    return min(stretch, max(1.0 / dense, math.sqrt(mean_rate / rate)))


class ConvergenceAware:
    """COCI-style convergence-aware policy; see the module docstring for the two schedules.

    Args:
        mtbf: mean time between failures (seconds or ``"4h"``).
        schedule: ``"value"`` (expected lost value, default) or ``"coci"`` (COCI's published schedule).
        metric: the metric holding the training loss (``maybe_save(..., metrics={"loss": l})``).
        cost, include_persist, profile_step: as for :class:`~crashsafe.policies.Young`.
        fit_step: first fit this many steps after the start (COCI: 50).
        refit_every: refit on the samples since the last fit every this many steps (COCI: 10,000);
            None refits when the steps since the start have grown by half since the last fit.
        refit_threshold: COCI rebuilds when |Δθ1| or |Δθ2| exceeds it (θ1 per minute; COCI: 0.1).
        horizon: the job's expected training time (e.g. an exploratory budget), over which ρ is taken;
            None: now plus the time the current fit needs for 95% of its remaining progress.
        dense, stretch: the value schedule stays within [τ_Daly/dense, τ_Daly·stretch].
        exact: use Daly's exact (Lambert-W) interval as the base.
    """

    def __init__(
        self,
        mtbf: float | str,
        *,
        schedule: Schedule = "value",
        metric: str = "loss",
        cost: float | str | None = None,
        include_persist: bool = False,
        profile_step: int = 10,
        fit_step: int = 50,
        refit_every: int | None = None,
        refit_threshold: float = 0.1,
        horizon: float | str | None = None,
        dense: float = 4.0,
        stretch: float = 1.3,
        exact: bool = False,
    ) -> None:
        if schedule not in ("value", "coci"):
            raise PolicyError(f"schedule must be 'value' or 'coci', got {schedule!r}")
        if isinstance(fit_step, bool) or not isinstance(fit_step, int) or fit_step < 3:
            raise PolicyError(f"fit_step must be an int >= 3, got {fit_step!r}")
        if refit_every is not None and (
            isinstance(refit_every, bool) or not isinstance(refit_every, int) or refit_every < 1
        ):
            raise PolicyError(f"refit_every must be None or an int >= 1, got {refit_every!r}")
        for name, number in (("dense", dense), ("stretch", stretch)):
            if not (isinstance(number, (int, float)) and math.isfinite(number) and number >= 1):
                raise PolicyError(f"{name} must be a finite number >= 1, got {number!r}")
        if not (isinstance(refit_threshold, (int, float)) and refit_threshold >= 0):
            raise PolicyError(f"refit_threshold must be >= 0, got {refit_threshold!r}")
        self.mtbf = check_mtbf(mtbf)
        self.schedule: Schedule = schedule
        self.metric = metric
        self.clock = CostClock(cost, include_persist, profile_step)
        self.fit_step, self.refit_every, self.refit_threshold = fit_step, refit_every, float(refit_threshold)
        self.horizon = None if horizon is None else parse_duration(horizon, "horizon")
        if self.horizon is not None and not 0 < self.horizon < math.inf:
            raise PolicyError(f"horizon must be a positive finite duration, got {horizon!r}")
        self.dense, self.stretch, self.exact = float(dense), float(stretch), bool(exact)
        self.fit: ExpFit | None = None
        self.initial_loss = math.nan
        self.fallback: str | None = "no loss-curve fit yet"
        self.fits = 0
        self._times: list[float] = []
        self._losses: list[float] = []
        self._next_fit_step: int | None = None
        self._needs_build = False
        self._targets: np.ndarray = np.empty(0)
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ decisions

    def should_save(self, context: SaveContext) -> bool:
        now = self.clock.observe(context)
        self._record(context, now)
        if math.isinf(self.mtbf):
            return False
        cost = self.clock.cost()
        if cost is None:
            return self.clock.profile_due(context)
        self._maybe_fit(context.step, now, cost)
        last = self.clock.last_save(context)
        if self.fallback is None and self.schedule == "coci":
            return self._coci_due(now)
        return now - last >= self.interval(last, cost)

    def interval(self, t_save: float, cost: float) -> float:
        """Training seconds from a save at policy time ``t_save`` to the next (value schedule or Daly)."""
        base = daly_interval(cost, self.mtbf, self.exact)
        if self.fit is None or self.fallback is not None or self.schedule == "coci":
            return base
        horizon = None if self.horizon is None else self.horizon / 60.0
        factor = value_factor(self.fit, t_save / 60.0, self.initial_loss, horizon, self.dense, self.stretch)
        return base * factor

    def _coci_due(self, now: float) -> bool:
        due = int(np.searchsorted(self._targets, now, side="right"))
        if due == 0:
            return False
        self._targets = self._targets[due:]
        return True

    # ------------------------------------------------------------------ fitting

    def _record(self, context: SaveContext, now: float) -> None:
        value = context.metrics.get(self.metric)
        try:
            loss = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            self._warn(f"metric {self.metric!r} is missing or not a number; pass "
                       f"maybe_save(..., metrics={{{self.metric!r}: loss}})")
            return
        if not math.isfinite(loss) or loss <= 0:
            self._warn(f"metric {self.metric!r} was {loss!r}; such samples are skipped")
            return
        self._times.append(now / 60.0)
        self._losses.append(loss)

    def _maybe_fit(self, step: int, now: float, cost: float) -> None:
        if self._next_fit_step is None:
            origin = self.clock.origin_step or 0
            first = self.fit_step - 1  # the fit_step-th step counting the first one seen (COCI: 50)
            self._next_fit_step = origin + (first if self.fit is None else self._refit_gap(origin))
        if self._needs_build:
            self._needs_build = False
            self._rebuild(now, cost)
        if step < self._next_fit_step:
            return
        first = self.fit is None
        try:
            fit = fit_exponential(self._times, self._losses)
        except FitError as exc:
            if first:  # keep the samples: the retry sees more of the curve
                self._next_fit_step = step + self.fit_step
                self._set_fallback(f"{exc}; retrying in {self.fit_step} steps")
            else:  # keep the previous fit
                self._next_fit_step = step + self._refit_gap(step)
                self._times.clear()
                self._losses.clear()
            return
        self._times.clear()
        self._losses.clear()
        self.fits += 1
        self._next_fit_step = step + self._refit_gap(step)
        if first:
            self.initial_loss = fit.loss(0.0)
        if self.fit is None or self.schedule == "value" or fit.moved(self.fit, self.refit_threshold):
            self.fit = fit
            self._rebuild(now, cost)

    def _refit_gap(self, step: int) -> int:
        if self.refit_every is not None:
            return self.refit_every
        return max(self.fit_step, (step - (self.clock.origin_step or 0)) // 2)

    def _rebuild(self, now: float, cost: float) -> None:
        assert self.fit is not None
        if self.schedule == "value":
            self.fallback = None
            return
        if not self.fit.decreasing:
            self._set_fallback(f"the fitted loss curve is not decreasing (θ1 = {self.fit.theta1:.3g}/min)")
            return
        pc = coci_protected_loss(self.fit.theta1, cost / 60.0, 60.0 / self.mtbf)
        if not (pc > 0 and math.isfinite(pc)):
            self._set_fallback(f"COCI's protected loss per checkpoint is {pc!r}")
            return
        self._targets = coci_schedule(self.fit, now / 60.0, cost / 60.0, 60.0 / self.mtbf) * 60.0
        self.fallback = None

    def _set_fallback(self, reason: str) -> None:
        self.fallback = reason
        self._warn(f"convergence-aware policy falls back to Daly's interval: {reason}")

    def _warn(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warn(message, PolicyWarning)

    # ------------------------------------------------------------------ state

    @property
    def targets(self) -> np.ndarray:
        """Pending COCI checkpoint times (policy seconds); empty for the value schedule."""
        return self._targets.copy()

    def state_dict(self) -> dict[str, Any]:
        """Clock, cost and fit, so a restored job keeps its schedule (put the policy in the state)."""
        state: dict[str, Any] = self.clock.state_dict()
        if self.fit is not None:
            state.update(theta1=self.fit.theta1, theta2=self.fit.theta2, initial_loss=self.initial_loss)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.clock.load_state_dict(state)
        self._times.clear()
        self._losses.clear()
        self._next_fit_step = None
        values = [state.get(k) for k in ("theta1", "theta2", "initial_loss")]
        if all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
            theta1, theta2, initial = (float(v) for v in values)  # type: ignore[arg-type]
            self.fit, self.initial_loss, self._needs_build = ExpFit(theta1, theta2), initial, True

    def __repr__(self) -> str:
        return f"ConvergenceAware(mtbf={self.mtbf:g}, schedule={self.schedule!r})"
