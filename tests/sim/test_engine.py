"""The Monte Carlo engine against closed forms, exact traces, and its own bookkeeping."""

from __future__ import annotations

import math

import numpy as np
import pytest

from crashsafe.policies import Daly, EverySteps, Young
from crashsafe.sim import (
    Exponential,
    FixedSteps,
    LossCurve,
    Profile,
    SimulationError,
    Trace,
    Weibull,
    compare,
    paired_ratio,
    simulate,
    simulate_schedule,
)


def _line(steps: int) -> LossCurve:
    return LossCurve(np.linspace(2.0, 1.0, steps))


def _daly_segment(work: float, mtbf: float, restart: float) -> float:
    return mtbf * math.exp(restart / mtbf) * math.expm1(work / mtbf)


def test_zero_cost_and_no_failures_means_zero_overhead() -> None:
    profile = Profile(_line(1000), step_time=2.0, stall=0.0, persist=0.0, restart=30.0)
    for policy in (EverySteps(10), Young(mtbf="inf"), Daly(100.0, cost=0.0)):
        result = simulate(policy, profile, Exponential("inf"), trials=1000)
        overhead = result.values("overhead")
        assert np.all(overhead == 0.0)
        assert np.all(result.values("wall") == 2000.0)
        assert result.estimate("progress_lost").mean == 0.0


def test_periodic_checkpoints_match_dalys_closed_form() -> None:
    mtbf, cost, restart, tau, segments = 100.0, 5.0, 10.0, 20.0, 50
    profile = Profile(_line(int(tau) * segments), step_time=1.0, stall=cost, persist=0.0, restart=restart)
    steps = np.arange(int(tau), int(tau) * segments, int(tau))
    result = simulate_schedule(steps, profile, Exponential(mtbf), int(tau) * segments, trials=20000, seed=3)
    expected = (segments - 1) * _daly_segment(tau + cost, mtbf, restart) + _daly_segment(tau, mtbf, restart)
    wall = result.estimate("wall")
    assert wall.low - 0.5 * (wall.high - wall.low) <= expected <= wall.high + 0.5 * (wall.high - wall.low)
    assert wall.mean == pytest.approx(expected, rel=0.005)


def test_overhead_is_stalls_plus_lost_work_plus_restarts() -> None:
    profile = Profile(_line(5000), step_time=1.0, stall=3.0, persist=7.0, restart=20.0)
    result = simulate(Young(600.0), profile, Weibull(600.0, 0.7), trials=500, seed=1)
    o = result.outcomes
    np.testing.assert_allclose(o.wall, o.compute + o.stalls + o.lost_work + o.restarts, rtol=1e-12)
    assert np.all(o.lost_work >= 0) and np.all(o.progress_lost >= 0)
    assert result.estimate("failures").mean > 1


def test_one_failure_replayed_exactly() -> None:
    # checkpoints at steps 100 and 200 (stall 5 s, persisted 30 s later); one failure at wall 232 s:
    # training reached 232 - 2*5 = 222 s of progress, the second checkpoint (durable at 235) is not
    # yet safe, so the job rolls back to step 100.
    profile = Profile(_line(400), step_time=1.0, stall=5.0, persist=30.0, restart=50.0)
    result = simulate_schedule(np.array([100, 200]), profile, Trace((232.0,), randomize=False), 400, trials=1)
    o = result.outcomes
    assert o.lost_work[0] == pytest.approx(122.0)
    assert o.restarts[0] == 50.0
    assert o.stalls[0] == pytest.approx(10.0 + 5.0)  # both stalls, and the second again after the restart
    assert o.wall[0] == pytest.approx(400 + 15 + 122 + 50)
    curve = profile.curve
    assert o.progress_lost[0] == pytest.approx(curve.progress_at(100.0) - curve.progress_at(222.0))
    # had the failure come after the persist, only 22 s would be lost
    later = simulate_schedule(np.array([100, 200]), profile, Trace((245.0,), randomize=False), 400, trials=1)
    assert later.outcomes.lost_work[0] == pytest.approx(245 - 10 - 200)


def test_failure_during_a_stall_and_during_a_restart() -> None:
    profile = Profile(_line(300), step_time=1.0, stall=10.0, persist=0.0, restart=40.0)
    # failure mid-stall (wall 105: 5 s into the stall of step 100), then again 20 s into the restart
    failures = Trace((105.0, 125.0), randomize=False)
    result = simulate_schedule(np.array([100]), profile, failures, 300, trials=1)
    o = result.outcomes
    assert o.failures[0] == 2
    assert o.lost_work[0] == pytest.approx(100.0)
    assert o.restarts[0] == pytest.approx(20.0 + 40.0)
    assert o.stalls[0] == pytest.approx(5.0 + 10.0)
    assert o.wall[0] == pytest.approx(125 + 40 + 300 + 10)


def test_same_seed_same_failures_for_every_policy() -> None:
    profile = Profile(_line(3000), step_time=1.0, stall=2.0, restart=5.0)
    a, b, c = compare({"a": Young(900.0), "b": Young(900.0), "c": Daly(900.0)}, profile, Exponential(900.0),
                      trials=300, seed=7)
    np.testing.assert_array_equal(a.values("wall"), b.values("wall"))
    assert paired_ratio(a, b, "overhead").mean == 1.0
    ratio = paired_ratio(c, a, "overhead")
    assert ratio.low <= ratio.mean <= ratio.high
    other = simulate(Young(900.0), profile, Exponential(900.0), trials=300, seed=8)
    assert not np.array_equal(a.values("wall"), other.values("wall"))


def test_hopeless_jobs_are_reported_unfinished() -> None:
    profile = Profile(_line(20000), step_time=1.0, restart=10.0)
    result = simulate_schedule(np.array([], dtype=np.int64), profile, Exponential(100.0), 20000, trials=50)
    assert result.unfinished == 50
    assert math.isnan(result.estimate("overhead").mean)


def test_weibull_and_trace_means() -> None:
    block = Weibull("1h", 0.7).block(0, 2000, 0, 20)
    assert block.mean() == pytest.approx(3600.0, rel=0.05)
    trace = Trace((10.0, 30.0, 60.0))
    assert trace.mtbf == 20.0
    gaps = trace.block(0, 5, 0, 6)
    assert set(np.unique(gaps[:, 1:])) <= {10.0, 20.0, 30.0}
    fixed = Trace((10.0, 30.0), randomize=False).block(0, 2, 0, 4)
    np.testing.assert_array_equal(fixed, [[10.0, 20.0, math.inf, math.inf]] * 2)


def test_trace_file(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "failures.txt"
    path.write_text("time\n# node crashes\n3600\n2h, node7\n3h\n")
    assert Trace.from_file(path).times == (3600.0, 7200.0, 10800.0)
    path.write_text("3600\nsoon\n")
    with pytest.raises(SimulationError, match="failures.txt:2"):
        Trace.from_file(path)


@pytest.mark.parametrize(
    "make",
    [lambda: Exponential(-1).mtbf, lambda: Weibull(10, 0.0), lambda: Trace(()), lambda: Trace((5.0, 3.0)),
     lambda: Profile(_line(10), step_time=0.0), lambda: Profile(_line(10), step_time=1.0, stall="inf"),
     lambda: FixedSteps(11).end_step(_line(10))],
)
def test_bad_simulation_input(make: object) -> None:
    with pytest.raises(SimulationError):
        make()  # type: ignore[operator]


def test_bad_schedules_are_refused() -> None:
    profile = Profile(_line(100), step_time=1.0)
    with pytest.raises(SimulationError, match="increase"):
        simulate_schedule(np.array([50, 40]), profile, Exponential(10.0), 100)
    with pytest.raises(SimulationError, match="trials"):
        simulate_schedule(np.array([50]), profile, Exponential(10.0), 100, trials=0)


def test_a_stall_past_what_a_float_holds_is_refused_or_bounded() -> None:
    """``crashsafe simulate --ckpt-cost 1e308s`` was an OverflowError traceback: the job's time
    overflowed to inf (two stalls), or its failures per block did (one stall: 2 * g_end)."""
    from crashsafe.sim.engine import run_trials

    profile = Profile(_line(100), step_time=1.0, stall=1e308)
    with pytest.raises(SimulationError, match="too large to simulate"):
        simulate_schedule(np.array([10, 20]), profile, Exponential(3600.0), 100, trials=4)
    outcomes = run_trials(
        np.array([10.0]), np.array([1e308]), 100.0, 0.0, 0.0, _line(100), 1.0, Exponential(3600.0),
        trials=4, seed=0, max_failures=20,
    )  # fmt: skip
    assert not outcomes.finished.any() and (outcomes.failures == 20).all()  # never finishes, in bounded work
