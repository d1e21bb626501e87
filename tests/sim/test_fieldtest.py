"""End to end: the digits CNN under real SIGKILLs on a Poisson schedule, against the simulator.

Small on purpose (a few kills, a short run); ``bench/policies.py`` runs the full version.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from crashsafe.sim.fieldtest import forecast, run_field
from crashsafe.workloads.eventlog import of_kind


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("policy", ["young", "convergence"])
def test_sigkilled_training_matches_the_forecast(tmp_path: Path, policy: str) -> None:
    run = run_field(tmp_path, policy, mtbf=10.0, steps=1000, kill_seed=464, ballast_mb=8.0,
                    max_kills=3, timeout=200)

    # the job finished every step although it was killed, each restart resuming from a checkpoint
    assert run.of("done")[-1]["step"] == 1000
    starts = run.of("start")  # a process killed while starting up logs none
    assert run.kills and len({s["pid"] for s in starts}) >= 2
    assert any(s["resumed_from"] for s in starts[1:])
    for start in starts[1:]:  # each from the newest commit, whether or not its report beat the kill
        before = [e for e in run.events if e["t"] <= start["t"]]
        logged = {e["step"] for e in of_kind(before, "committed")}
        trained = {e["step"] for e in of_kind(before, "step")}
        resumed = start["resumed_from"] or 0
        assert resumed >= max(logged, default=0) and resumed in logged | trained | {0}, (resumed, logged)
    assert run.lost_steps >= 0

    # the simulator, fed this run's measurements and its very kill times, predicts its wall time
    predicted = forecast(run, trials=1000)
    same = predicted.same_kills.estimate("wall").mean
    assert same == pytest.approx(run.wall, rel=0.4)
    # and under Poisson failures of the same MTBF the run lies inside the predicted spread
    walls = predicted.poisson.values("wall")
    low, high = np.nanpercentile(walls, [0.5, 99.5])
    assert low <= run.wall <= high
    lost = predicted.poisson.values("lost_work") / predicted.profile.step_time
    assert run.lost_steps <= np.nanpercentile(lost, 99.5)


class _Counting:
    """A trainer whose state is 4 MiB of numbers (its staging allocated at the first save)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {"w": np.zeros(1 << 19), "step": 0}

    @property
    def step(self) -> int:
        return int(self.state["step"])

    def train_step(self) -> float:
        self.state["w"] += 1.0
        self.state["step"] += 1
        return 1.0 / self.step


def test_the_forecast_gives_its_policy_the_stall_the_run_s_policy_saw(tmp_path: Path) -> None:
    """The run's policy sees each save's stall less the one-time allocation of staging buffers
    (``SaveStats.setup``, paid once a process); the forecast gave its policy the logged stalls with
    it, so it simulated longer intervals than the run's. The log carries the setup, the forecast's
    policy sees the stall without it, and it is paid once a process, with the restart."""
    from crashsafe.manager import CheckpointManager
    from crashsafe.sim.fieldtest import FieldRun
    from crashsafe.workloads.eventlog import EventTail
    from crashsafe.workloads.supervised import train_logged

    log = tmp_path / "events.jsonl"
    with CheckpointManager(tmp_path / "ck", keep_last=2) as mgr:
        train_logged(_Counting(), mgr, log, 12, spawned=time.time(), save_every=3)
    events = EventTail(log).read()
    start = of_kind(events, "start")[0]["t"]
    for e in events:  # (as run_field gives them)
        e["t"] -= start
        if "spawned" in e:
            e["spawned"] -= start
    run = FieldRun("young", 10.0, 12, [1e6], events, of_kind(events, "done")[-1]["t"])  # (killed never)
    committed = run.of("committed")
    assert len(committed) == 4 and committed[0]["setup"] > 0
    profile = forecast(run, trials=10).profile
    assert profile.stall == pytest.approx(np.mean([e["stall"] - e["setup"] for e in committed]))
    setup = sum(e["setup"] for e in committed) / len(run.restarts)
    assert profile.restart == pytest.approx(np.mean(run.restarts) + setup)
