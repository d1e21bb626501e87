"""End to end: the digits CNN under real SIGKILLs on a Poisson schedule, against the simulator.

Small on purpose (a few kills, a short run); ``bench/policies.py`` runs the full version.
"""

from __future__ import annotations

from pathlib import Path

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
