"""COCI's published schedule reproduced exactly, the value schedule, fallbacks and restore."""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pytest

from crashsafe.policies import (
    ConvergenceAware,
    ExpFit,
    PolicyError,
    PolicyWarning,
    coci_protected_loss,
    coci_schedule,
    daly_interval,
    value_factor,
)


def test_pc_is_cocis_formula_verbatim() -> None:
    theta1, ts, lam = -0.02, 0.5, 0.0042
    expected = (1 - math.exp(theta1 * ts)) * (1 / (2 * lam) - 1 / (2 * theta1))
    assert coci_protected_loss(theta1, ts, lam) == expected
    assert expected == pytest.approx(0.00995 * (119.0476 + 25.0), rel=1e-3)


def test_schedule_protects_equal_loss_decreases() -> None:
    fit = ExpFit(-0.01, math.log(2.3))
    ts, lam, now = 0.05, 0.0042, 10.0
    times = coci_schedule(fit, now, ts, lam)
    pc = coci_protected_loss(fit.theta1, ts, lam)
    l_now = fit.loss(now)
    assert times.size == math.floor(l_now / pc) > 3
    losses = np.array([fit.loss(t) for t in times])
    np.testing.assert_allclose(l_now - losses, pc * np.arange(1, times.size + 1), rtol=1e-9)
    assert np.all(np.diff(np.diff(times)) > 0)  # equal progress: intervals grow as the loss flattens


def test_schedule_with_cocis_wall_clock_shift() -> None:
    fit = ExpFit(-0.01, math.log(2.3))
    plain = coci_schedule(fit, 10.0, 0.5, 0.0042)
    shifted = coci_schedule(fit, 10.0 + 3 * 0.5, 0.5, 0.0042, n_done=3)
    np.testing.assert_allclose(shifted, plain + 3 * 0.5)


def test_schedule_is_empty_when_the_curve_does_not_decrease() -> None:
    assert coci_schedule(ExpFit(0.01, 0.0), 1.0, 0.5, 0.0042).size == 0
    assert coci_schedule(ExpFit(-0.01, 0.0), 1.0, 0.0, 0.0042).size == 0  # pc = 0


def test_value_factor_dense_early_sparse_late_and_clamped() -> None:
    fit = ExpFit(-0.1, math.log(2.0))
    early = value_factor(fit, 0.0, 2.0, None, 4.0, 1.3)
    assert early == pytest.approx(math.sqrt((1 - 1 / 20) / math.log(20)), rel=1e-6)  # ρ/r(0)
    late = value_factor(fit, 60.0, 2.0, None, 4.0, 1.3)
    assert early < 1 < late == 1.3
    assert value_factor(ExpFit(0.1, 0.0), 1.0, 2.0, None, 4.0, 1.3) == 1.3  # not decreasing
    assert value_factor(fit, 0.0, 2.0, 1e6, 4.0, 1.3) == 0.25  # a long horizon: loss is precious now
    factors = [value_factor(fit, t, 2.0, None, 100.0, 100.0) for t in np.linspace(0, 50, 20)]
    assert np.all(np.diff(factors) > 0)


def _exp_loss(theta1: float, theta2: float) -> Any:
    return lambda t: math.exp(theta1 * t / 60.0 + theta2)


def test_coci_mode_saves_at_the_published_targets(driver: Any) -> None:
    theta1, theta2, cost, mtbf = -0.5, math.log(2.3), 1.0, 3600.0
    policy = ConvergenceAware(mtbf, schedule="coci", cost=cost, fit_step=50, refit_every=10_000)
    d = driver(policy, dt=1.0, stall=cost)
    saves = d.run(3000, _exp_loss(theta1, theta2))
    assert policy.fit is not None and policy.fit.theta1 == pytest.approx(theta1, rel=1e-6)
    targets = coci_schedule(policy.fit, 50 / 60.0, cost / 60.0, 60.0 / mtbf) * 60.0
    assert saves == [math.ceil(t) for t in targets]
    assert len(saves) > 3


def test_value_mode_protects_early_progress_more_densely(driver: Any) -> None:
    theta1, cost, mtbf = -0.05, 5.0, 4 * 3600.0
    policy = ConvergenceAware(mtbf, cost=cost)
    saves = driver(policy, dt=5.0, stall=cost).run(20_000, _exp_loss(theta1, 1.0))
    gaps = np.diff(saves) * 5.0
    base = daly_interval(cost, mtbf)
    assert gaps[0] < 0.8 * base  # fast progress: denser than Daly
    assert gaps[-1] == pytest.approx(1.3 * base, abs=5.0)  # flat: the stretch bound
    assert policy.fallback is None and policy.fits > 3


def test_nan_and_missing_losses_fall_back_to_daly_without_crashing(driver: Any) -> None:
    policy = ConvergenceAware(3600.0, cost=10.0)
    with pytest.warns(PolicyWarning) as record:
        saves = driver(policy, dt=1.0, stall=10.0).run(2000, lambda t: math.nan)
    messages = [str(w.message) for w in record]
    assert any("skipped" in m for m in messages) and any("falls back to Daly" in m for m in messages)
    assert policy.fit is None and "fit" in (policy.fallback or "")
    tau = daly_interval(10.0, 3600.0)
    assert np.diff(saves).tolist() == [math.ceil(tau)] * (len(saves) - 1)

    silent = ConvergenceAware(3600.0, cost=10.0, metric="val_loss")
    with pytest.warns(PolicyWarning) as record:
        assert driver(silent, dt=1.0, stall=10.0).run(1000) == [math.ceil(tau) * k for k in (1, 2, 3)]
    assert any("val_loss" in str(w.message) for w in record)


def test_coci_falls_back_when_the_fitted_curve_rises(driver: Any) -> None:
    policy = ConvergenceAware(3600.0, schedule="coci", cost=10.0)
    with pytest.warns(PolicyWarning, match="not decreasing"):
        saves = driver(policy, dt=1.0, stall=10.0).run(1000, lambda t: 0.5 + 0.001 * t)
    assert saves and policy.fallback is not None


def test_coci_rebuilds_when_a_refit_moves_the_curve(driver: Any) -> None:
    def kinked(t: float) -> float:  # the slope changes at 100 s
        return math.exp(-0.6 * t / 60) if t < 100 else math.exp(-0.6 * 100 / 60 - 6.0 * (t - 100) / 60)

    policy = ConvergenceAware(3600.0, schedule="coci", cost=1.0, fit_step=50, refit_every=60)
    d = driver(policy, dt=1.0, stall=1.0)
    d.run(60, kinked)
    first = policy.fit
    d.run(120, kinked)
    assert policy.fits >= 3 and policy.fit is not None and first is not None
    assert first.theta1 == pytest.approx(-0.6, rel=0.05)
    assert policy.fit.theta1 == pytest.approx(-6.0, rel=0.05)


def test_state_dict_carries_clock_cost_and_fit_across_a_restart(driver: Any) -> None:
    loss = _exp_loss(-0.05, 1.0)
    a = ConvergenceAware(4 * 3600.0)
    da = driver(a, dt=5.0, stall=5.0)
    da.run(3000, loss)
    while not da.run(1, loss):  # the manager calls state_dict() while it saves
        pass
    state = a.state_dict()
    b = ConvergenceAware(4 * 3600.0)
    b.load_state_dict(state)
    assert b.fit == a.fit and b.clock.known_cost == 5.0
    db = driver(b, dt=5.0, stall=None, start_step=da.step)  # new process: no measurement yet
    db.time = 0.0
    db.last = None
    later_a = da.run(3000, loss)
    later_b = db.run(3000, lambda t: loss(t + state["clock"]))
    assert later_b and abs(later_b[0] - later_a[0]) <= 2  # same schedule, no profiling save


@pytest.mark.parametrize(
    "kwargs",
    [dict(schedule="nope"), dict(stretch=0.5), dict(dense=math.inf), dict(fit_step=2), dict(refit_every=0),
     dict(horizon=-1), dict(refit_threshold=-1)],
)
def test_bad_configuration_is_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(PolicyError):
        ConvergenceAware(3600.0, **kwargs)


def test_warnings_are_issued_once() -> None:
    policy = ConvergenceAware(3600.0, cost=1.0)
    from crashsafe.policies import SaveContext

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 200):
            policy.should_save(SaveContext(step=step, train_time=float(step), metrics={"loss": math.inf}))
    assert len([w for w in caught if issubclass(w.category, PolicyWarning)]) == 2  # skipped + no fit
