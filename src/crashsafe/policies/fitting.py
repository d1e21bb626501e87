"""Fit the loss curve L(t) = exp(θ1·t + θ2) with scipy's ``curve_fit`` (COCI's model).

t is training time in minutes (checkpoint stalls excluded), as in COCI, so θ1 is per minute.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from crashsafe.policies.errors import FitError

__all__ = ["ExpFit", "fit_exponential"]


@dataclass(frozen=True)
class ExpFit:
    """L(t) = exp(θ1·t + θ2), t in minutes; ``decreasing`` when θ1 < 0."""

    theta1: float
    theta2: float

    def loss(self, t_min: float) -> float:
        """Fitted loss at ``t_min`` minutes (``inf`` when it overflows)."""
        exponent = self.theta1 * t_min + self.theta2
        return math.exp(exponent) if exponent < 700 else math.inf

    def rate(self, t_min: float) -> float:
        """Loss decrease per minute at ``t_min`` (−dL/dt; 0 when the fit is not decreasing)."""
        return max(0.0, -self.theta1 * self.loss(t_min))

    @property
    def decreasing(self) -> bool:
        return self.theta1 < 0

    def moved(self, other: ExpFit, threshold: float) -> bool:
        """COCI's rebuild test: |Δθ1| > threshold or |Δθ2| > threshold."""
        return abs(self.theta1 - other.theta1) > threshold or abs(self.theta2 - other.theta2) > threshold


def fit_exponential(t_min: Sequence[float] | np.ndarray, loss: Sequence[float] | np.ndarray) -> ExpFit:
    """Least-squares fit of exp(θ1·t + θ2) to (t, loss); starts from the log-linear fit.

    Non-finite and non-positive losses are dropped. Raises :class:`FitError` when fewer than 3 usable
    points or less than 2 distinct times remain, or when the optimiser fails.
    """
    t = np.asarray(t_min, dtype=np.float64)
    y = np.asarray(loss, dtype=np.float64)
    if t.shape != y.shape or t.ndim != 1:
        raise FitError(f"times and losses must be 1-d of equal length, got {t.shape} and {y.shape}")
    keep = np.isfinite(t) & np.isfinite(y) & (y > 0)
    t, y = t[keep], y[keep]
    if t.size < 3 or np.ptp(t) <= 0:
        raise FitError(
            f"need at least 3 finite positive losses at 2+ distinct times to fit the loss curve, "
            f"got {t.size}; log the loss with maybe_save(..., metrics={{'loss': value}})"
        )
    from scipy.optimize import OptimizeWarning, curve_fit

    t0 = float(t.mean())  # centre time for conditioning; shifted back below
    slope, intercept = np.polyfit(t - t0, np.log(y), 1)

    def model(x: np.ndarray, a: float, b: float) -> np.ndarray:
        return np.exp(np.clip(a * x + b, -700.0, 700.0))

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", OptimizeWarning)
            (a, b), _ = curve_fit(model, t - t0, y, p0=(slope, intercept), maxfev=2000)
    except (RuntimeError, ValueError, OptimizeWarning, FloatingPointError) as exc:
        raise FitError(f"the loss curve could not be fitted by exp(θ1·t + θ2): {exc}") from None
    theta1, theta2 = float(a), float(b - a * t0)
    if not (math.isfinite(theta1) and math.isfinite(theta2)):
        raise FitError(f"the loss-curve fit diverged (θ1={theta1}, θ2={theta2})")
    return ExpFit(theta1, theta2)
