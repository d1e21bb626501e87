"""Young, Daly and MaxOverhead on measured costs; combinators; the real manager feeding them."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crashsafe as cs
from crashsafe.policies import (
    AllOf,
    AnyOf,
    Daly,
    EverySteps,
    MaxOverhead,
    PolicyError,
    SaveContext,
    Young,
    daly_interval,
    policy_from_name,
)


def test_young_profiles_once_then_saves_at_its_interval(driver: Any) -> None:
    d = driver(Young(mtbf=200.0), dt=1.0, stall=1.0)  # interval sqrt(2*1*200) = 20 s
    saves = d.run(100)
    assert saves[0] == 10  # the profiling save measures the cost
    assert np.diff(saves).tolist() == [20] * (len(saves) - 1)


def test_interval_follows_the_measured_cost_as_it_changes(driver: Any) -> None:
    d = driver(Young(mtbf=200.0), dt=1.0, stall=1.0)
    d.run(60)
    d.stall = 4.0  # checkpoints got 4x dearer: the interval doubles
    before = len(d.saves)
    saves = d.run(200)
    assert len(d.saves) > before
    assert set(np.diff(saves).tolist()) == {40}


def test_no_second_save_while_the_profiling_save_persists() -> None:
    policy = Young(mtbf=100.0)
    decisions = [policy.should_save(SaveContext(step=s, train_time=float(s))) for s in range(1, 11)]
    assert decisions == [False] * 9 + [True]
    # saved, but its cost is not measured yet (still persisting): wait, whatever the time
    pending = SaveContext(step=500, train_time=500.0, last_save_step=10, last_save_train_time=10.0)
    assert not policy.should_save(pending)


def test_fixed_cost_skips_profiling(driver: Any) -> None:
    saves = driver(Daly(mtbf=3600.0, cost=2.0), dt=1.0, stall=None).run(400)
    tau = daly_interval(2.0, 3600.0)
    assert saves[0] == math.ceil(tau)  # the first interval counts from the start of training


def test_infinite_mtbf_never_saves(driver: Any) -> None:
    assert driver(Young(mtbf="inf"), dt=1.0).run(1000) == []


def test_daly_exact_and_expected_wall_time() -> None:
    daly = Daly("6h", restart="5min", exact=True)
    assert daly.interval(300.0) / 60 == pytest.approx(56.71, abs=0.01)
    work = 10 * 3600.0
    assert daly.expected_wall_time(work, 300.0) > work
    assert Daly("6h", restart="5min").expected_wall_time(work, 300.0) == pytest.approx(
        daly.expected_wall_time(work, 300.0), rel=1e-4
    )


def test_max_overhead_keeps_stalls_within_the_fraction(driver: Any) -> None:
    d = driver(MaxOverhead(0.05), dt=1.0, stall=2.0)  # 2 s stall allowed once per 38 s of training
    saves = d.run(500)
    gaps = np.diff(saves)
    assert set(gaps.tolist()) == {38}
    stalls, train = 2.0 * len(saves), 500.0
    assert stalls / (stalls + train) <= 0.05


def test_all_caps_young_with_max_overhead(driver: Any) -> None:
    young_only = driver(Young(mtbf=50.0), dt=1.0, stall=4.0).run(600)  # sqrt(400) = 20 s
    capped = driver(AllOf(Young(mtbf=50.0), MaxOverhead(0.1)), dt=1.0, stall=4.0).run(600)  # >= 36 s
    assert set(np.diff(young_only).tolist()) == {20}
    assert min(np.diff(capped)) >= 36
    either = driver(AnyOf(EverySteps(25), Young(mtbf=50.0)), dt=1.0, stall=4.0).run(100)
    assert {25, 50, 75, 100} <= set(either)


@pytest.mark.parametrize(
    "make",
    [lambda: Young(-1), lambda: Young(0), lambda: Daly("soon"), lambda: MaxOverhead(0.0),
     lambda: MaxOverhead(1.5), lambda: Young(10, profile_step=-1), lambda: Young(10, cost=-3)],
)
def test_bad_configuration_is_refused(make: Any) -> None:
    with pytest.raises(PolicyError):
        make()


@pytest.mark.parametrize(
    ("name", "kind"),
    [("young", "Young"), ("daly", "Daly"), ("daly-exact", "Daly"), ("coci", "ConvergenceAware"),
     ("convergence", "ConvergenceAware"), ("every:7", "EverySteps"), ("seconds:30s", "EverySeconds"),
     ("overhead:0.05", "MaxOverhead")],
)
def test_policies_by_name(name: str, kind: str) -> None:
    assert type(policy_from_name(name, mtbf="4h")).__name__ == kind


@pytest.mark.parametrize("name", ["nope", "every:x", "overhead:2"])
def test_bad_policy_names(name: str) -> None:
    with pytest.raises(PolicyError):
        policy_from_name(name, mtbf="4h")


def _train(mgr: cs.CheckpointManager, state: dict[str, Any], steps: range, pause: float) -> list[int]:
    saved = []
    for step in steps:
        time.sleep(pause)
        state["w"] += 1.0
        state["step"] = step
        if mgr.maybe_save(step, state, metrics={"loss": 1.0 / step}):
            saved.append(step)
    return saved


@pytest.mark.timeout(60)
def test_manager_measures_the_cost_for_young(tmp_path: Path) -> None:
    policy = Young(mtbf=0.5)
    state = {"w": np.zeros(2**20), "step": 0}
    with cs.CheckpointManager(tmp_path / "ck", policy=policy, keep_last=2) as mgr:
        saved = _train(mgr, state, range(1, 12), 0.002)
        assert saved == [10]  # profiling save only
        deadline = time.time() + 10
        while mgr.context(11).stall is None and time.time() < deadline:
            time.sleep(0.01)  # the finished background save becomes visible without another save
        stall = mgr.context(11).stall
        assert stall is not None and stall > 0
        saved = _train(mgr, state, range(12, 400), 0.002)
    assert len(saved) >= 2
    stalls = [s.recurring_stall for s in mgr.stats]
    assert policy.last_interval is not None
    planned_cost = policy.last_interval**2 / (2 * 0.5)  # Young: interval = sqrt(2 * cost * mtbf)
    assert min(stalls) * 0.999 <= planned_cost <= max(stalls) * 1.001


@pytest.mark.timeout(60)
def test_a_policy_is_not_charged_the_staging_buffers_a_first_save_allocates(tmp_path: Path) -> None:
    """A process's first save allocates its staging buffers (about 40 times a later save's whole
    stall), and a tensor that changes shape gets a new one: what a policy sees as the cost of a save
    leaves that out, so Young's first intervals after a start are not several times too long."""
    state = {"w": np.zeros(2**22), "step": 0}  # 32 MiB of staging to allocate
    with cs.CheckpointManager(tmp_path / "ck") as mgr:
        for step in (1, 2, 3):
            state["w"] = state["w"] + 1.0 if step < 3 else np.zeros(2**21)  # step 3: a new shape
            mgr.save(step, state)
            mgr.wait()
        first, second, third = mgr.stats
        assert first.setup > 0 and third.setup > 0  # new buffers
        assert second.setup == 0.0  # the first save's buffers, reused
        for s in mgr.stats:
            assert 0 < s.setup <= s.stall or s.setup == 0.0
            assert s.recurring_stall == pytest.approx(s.stall - s.setup)
        recurring = [s.recurring_stall for s in mgr.stats]
        assert mgr.context(4).stall == pytest.approx(sum(recurring) / 3)
    with cs.CheckpointManager(tmp_path / "sync", async_save=False) as mgr:
        mgr.save(1, state)  # no staging: nothing allocated, all of the wait recurs
        assert mgr.stats[0].setup == 0.0 and mgr.stats[0].recurring_stall == mgr.stats[0].stall


@pytest.mark.timeout(60)
def test_staging_a_state_whose_shapes_change_at_every_save_allocates_is_charged_every_save(
    tmp_path: Path,
) -> None:
    """A tensor that changes shape at every save (a growing buffer) gets new staging at every save:
    counted as one-time setup, that cost was left out of every save, and a policy saw a fraction of
    the stall each save paid (a cost-based policy then saves too often). An allocation recurs when
    the save before also allocated: only the first save's, or one after a save that allocated none,
    is setup."""
    with cs.CheckpointManager(tmp_path / "ck") as mgr:
        for step in range(1, 6):
            mgr.save(step, {"w": np.ones(2**20 + step * 4096), "step": step})  # a new shape each save
            mgr.wait()
        first, *later = mgr.stats
        assert first.setup > 0  # the first buffers: once
        for s in later:
            assert s.setup == 0.0 and s.recurring_stall == s.stall, s
        assert mgr.context(6).stall == pytest.approx(sum(s.recurring_stall for s in mgr.stats) / 5)


@pytest.mark.timeout(60)
def test_policy_in_the_state_keeps_its_clock_and_cost_across_restarts(tmp_path: Path) -> None:
    first = Daly(mtbf=2.0)
    state = {"w": np.zeros(1000), "step": 0, "policy": first}
    with cs.CheckpointManager(tmp_path / "ck", policy=first, keep_last=2) as mgr:
        _train(mgr, state, range(1, 300), 0.001)
        mgr.save(300, state)
        clock, cost = first.clock.now, first.clock.known_cost
    assert cost is not None
    second = Daly(mtbf=2.0)
    fresh = {"w": np.zeros(1000), "step": 0, "policy": second}
    with cs.CheckpointManager(tmp_path / "ck", policy=second, keep_last=2) as mgr:
        assert mgr.restore(fresh) == 300
        assert second.clock.known_cost == pytest.approx(cost)
        assert second.should_save(mgr.context(301)) is False  # no re-profiling, schedule continues
        assert second.clock.now == pytest.approx(clock, abs=0.5)


def test_the_old_combinator_names_still_work_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match="AnyOf"):
        from crashsafe.policies import Any as OldAny
    with pytest.warns(DeprecationWarning, match="AllOf"):
        old_all = cs.policies.All
    assert OldAny is AnyOf and old_all is AllOf
