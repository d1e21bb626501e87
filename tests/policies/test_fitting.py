"""The loss-curve fit recovers known parameters and refuses what it cannot fit."""

from __future__ import annotations

import math

import numpy as np
import pytest

from crashsafe.policies import ExpFit, FitError, fit_exponential


@pytest.mark.parametrize(("theta1", "theta2"), [(-0.05, 0.8), (-0.5, -1.0), (-0.002, 2.0)])
def test_recovers_known_theta_from_noisy_losses(theta1: float, theta2: float) -> None:
    rng = np.random.default_rng(0)
    t = np.linspace(0.0, 3.0 / -theta1, 400)
    loss = np.exp(theta1 * t + theta2) * (1 + 0.03 * rng.standard_normal(t.size))
    fit = fit_exponential(t, loss)
    assert fit.theta1 == pytest.approx(theta1, rel=0.03)
    assert fit.theta2 == pytest.approx(theta2, abs=0.03)
    assert fit.decreasing


def test_non_finite_and_non_positive_losses_are_dropped() -> None:
    t = np.arange(50, dtype=float)
    loss = np.exp(-0.1 * t + 1.0)
    loss[[3, 10, 20]] = [math.nan, math.inf, -1.0]
    fit = fit_exponential(t, loss)
    assert fit.theta1 == pytest.approx(-0.1, rel=1e-6)


def test_rising_curve_fits_with_positive_theta1() -> None:
    t = np.arange(30, dtype=float)
    fit = fit_exponential(t, np.exp(0.01 * t))
    assert fit.theta1 > 0 and not fit.decreasing
    assert fit.rate(5.0) == 0.0


@pytest.mark.parametrize(
    ("t", "loss"),
    [([], []), ([1.0, 2.0], [1.0, 0.5]), ([1.0, 1.0, 1.0], [1.0, 0.9, 0.8]),
     ([1.0, 2.0, 3.0], [math.nan] * 3)],
)
def test_unfittable_inputs_raise_fit_error(t: list[float], loss: list[float]) -> None:
    with pytest.raises(FitError, match="fit"):
        fit_exponential(t, loss)


def test_mismatched_lengths_raise() -> None:
    with pytest.raises(FitError, match="equal length"):
        fit_exponential([1.0, 2.0, 3.0], [1.0, 2.0])


def test_expfit_helpers() -> None:
    fit = ExpFit(-0.1, math.log(2.0))
    assert fit.loss(0.0) == pytest.approx(2.0)
    assert fit.rate(0.0) == pytest.approx(0.2)
    assert fit.loss(-1e5) == math.inf
    assert fit.moved(ExpFit(-0.25, math.log(2.0)), 0.1)
    assert not fit.moved(ExpFit(-0.15, math.log(2.0) + 0.05), 0.1)
