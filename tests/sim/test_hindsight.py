"""``Hindsight``: the value rule fed the true curve, against Daly's interval and in the simulator."""

from __future__ import annotations

import numpy as np
import pytest

from crashsafe.policies import Young
from crashsafe.policies.young_daly import daly_interval
from crashsafe.sim import (
    Exponential,
    FixedSteps,
    Hindsight,
    LossCurve,
    Profile,
    SimulationError,
    paired_ratio,
    replay,
    simulate,
)

STEP = 10.0


def _gaps(policy: Hindsight, profile: Profile) -> np.ndarray:
    steps = replay(policy, profile, profile.curve.steps).steps
    return np.diff(np.concatenate([[0], steps]))


def test_constant_progress_rate_gives_dalys_interval() -> None:
    profile = Profile(LossCurve(np.linspace(3.0, 1.0, 20_000)), STEP, stall=30.0)
    gaps = _gaps(Hindsight(profile, 3600.0), profile)
    expected = np.ceil(daly_interval(30.0, 3600.0) / STEP)
    # the moving average's edges see a lower rate; away from them every interval is Daly's
    assert np.all(np.abs(gaps[2:-2] - expected) <= 1)


def test_fast_early_progress_is_protected_densely_and_slow_late_progress_sparsely() -> None:
    curve = LossCurve.exponential(-0.02, 1.0, 20_000, STEP)  # e-folds every 50 minutes
    profile = Profile(curve, STEP, stall=30.0)
    gaps = _gaps(Hindsight(profile, 3600.0), profile)
    daly_steps = daly_interval(30.0, 3600.0) / STEP
    assert gaps[0] < 0.5 * daly_steps
    assert gaps[-2] > 2.0 * daly_steps
    assert np.all(np.diff(gaps[1:-1]) >= -1)  # intervals only grow as the rate falls


def test_large_mu_stays_close_to_daly() -> None:
    curve = LossCurve.exponential(-0.02, 1.0, 20_000, STEP)
    profile = Profile(curve, STEP, stall=30.0)
    policy = Hindsight(profile, 3600.0, mu=1e6)
    assert all(abs(policy.factor(step) - 1.0) < 0.01 for step in range(0, 20_000, 500))


def test_it_loses_less_progress_than_young_on_a_steep_curve() -> None:
    curve = LossCurve.exponential(-0.02, 1.0, 20_000, STEP)
    profile = Profile(curve, STEP, stall=30.0, persist=30.0)
    failures = Exponential(3600.0)
    ours = simulate(Hindsight(profile, 3600.0), profile, failures, trials=1000)
    young = simulate(Young(3600.0, cost=30.0), profile, failures, trials=1000)
    ratio = paired_ratio(ours, young, "weighted")
    assert ratio.high < 0.8


def test_the_end_rule_sets_the_mean_rate() -> None:
    curve = LossCurve.exponential(-0.02, 1.0, 20_000, STEP)
    profile = Profile(curve, STEP, stall=30.0)
    whole = Hindsight(profile, 3600.0)
    early = Hindsight(profile, 3600.0, FixedSteps(2_000))
    # over a short job the early rate is closer to the mean: less densification than over the long one
    assert early.factor(10) > whole.factor(10)


@pytest.mark.parametrize(
    "options", [{"mu": -1.0}, {"dense": 0.5}, {"stretch": float("nan")}, {"window": 1.5}]
)
def test_bad_options_are_refused(options: dict[str, float]) -> None:
    profile = Profile(LossCurve(np.linspace(3.0, 1.0, 100)), STEP, stall=1.0)
    with pytest.raises(SimulationError):
        Hindsight(profile, 3600.0, **options)  # type: ignore[arg-type]
