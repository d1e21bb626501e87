"""End-to-end check of the simulator: real training, real SIGKILLs on a Poisson schedule, vs forecast.

:func:`run_field` trains the digits CNN (``crashsafe.sim.fieldtrainer``) under one policy while a
supervisor SIGKILLs it at exponentially distributed wall-clock gaps (seeded) and restarts it at once;
it measures wall time, lost steps, checkpoint costs and restart times. :func:`forecast` feeds those
measurements (the run's own loss curve, step time, stall as its policy saw it, persist, restart
with the one-time staging setup of each process) to the simulator, twice:
replaying the very kill times of the run (one deterministic trial), and under Poisson failures of
the same MTBF (many trials, giving the spread a single run should fall in).
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from crashsafe.policies.names import policy_from_name
from crashsafe.sim.curve import LossCurve
from crashsafe.sim.endrules import FixedSteps
from crashsafe.sim.failures import Exponential, Trace
from crashsafe.sim.profile import Profile
from crashsafe.sim.result import SimResult
from crashsafe.sim.simulate import simulate
from crashsafe.workloads.eventlog import Event, lost_steps, of_kind
from crashsafe.workloads.supervisor import PoissonKills, supervise

__all__ = ["FieldRun", "Forecast", "forecast", "run_field"]


@dataclass
class FieldRun:
    """What happened in one supervised run (times in seconds from the start of training)."""

    policy: str
    mtbf: float
    steps: int
    kills: list[float] = field(default_factory=list)  # kill times
    events: list[Event] = field(default_factory=list)
    wall: float = 0.0  # training start to done

    def of(self, kind: str) -> list[Event]:
        return of_kind(self.events, kind)

    @property
    def lost_steps(self) -> int:
        """Steps trained but not committed before a kill, so trained again after the restart."""
        return lost_steps(self.events)

    @property
    def curve(self) -> LossCurve:
        """Loss per step, from the run itself (training is deterministic, so replays agree)."""
        losses = np.full(self.steps, np.nan)
        for e in self.of("step"):
            losses[e["step"] - 1] = e["loss"]
        return LossCurve(losses, name="digits")

    @property
    def step_time(self) -> float:
        """Mean seconds per step while training ran (gaps holding a restart or a save left out)."""
        saved = {e["step"] for e in self.of("committed")}
        gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(self.of("step"))
                if b["pid"] == a["pid"] and b["step"] == a["step"] + 1 and a["step"] not in saved]
        return float(np.mean(gaps))

    @property
    def restarts(self) -> list[float]:
        """Seconds from a process's launch to its first trained step, for each process that trained.

        The first process counts too (its launch is a restart's cost as well); the supervisor launches
        a new process within milliseconds of a kill.
        """
        first_step: dict[int, float] = {}
        for e in self.of("step"):
            first_step.setdefault(e["pid"], e["t"])
        return [max(0.0, first_step[e["pid"]] - e["spawned"] - self.step_time)
                for e in self.of("start") if e["pid"] in first_step]


@dataclass(frozen=True)
class Forecast:
    """The simulator's view of a field run: same kills (one trial) and Poisson (many trials)."""

    same_kills: SimResult
    poisson: SimResult
    profile: Profile


def run_field(
    work: Path,
    policy: str,
    mtbf: float,
    *,
    steps: int = 2000,
    kill_seed: int = 0,
    ballast_mb: float = 32.0,
    max_kills: int | None = None,
    timeout: float = 600.0,
) -> FieldRun:
    """Train under ``policy`` in ``work`` while SIGKILLing at Poisson times of mean ``mtbf`` seconds.

    ``max_kills`` stops the kills after that many (a bound on the run's length when restarts are
    slow, e.g. on a loaded machine); the forecast replays exactly the kills that happened. The
    trainer's checkpoints go to ``work/ckpt``, its events to ``work/events.jsonl``, its stderr to
    ``work/trainer.log``.
    """
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "crashsafe.sim.fieldtrainer", "--dir", str(work / "ckpt"),
           "--log", str(work / "events.jsonl"), "--policy", policy, "--mtbf", repr(mtbf),
           "--steps", str(steps), "--seed", "0", "--ballast-mb", repr(ballast_mb)]
    supervised = supervise(cmd, work / "events.jsonl", PoissonKills(mtbf, kill_seed, max_kills),
                           stderr=work / "trainer.log", name=f"the field run of {policy}", timeout=timeout)
    start = supervised.training_start
    assert start is not None, "the trainer finished without training a step"
    for e in supervised.events:
        e["t"] -= start
        if "spawned" in e:
            e["spawned"] -= start
    kills = [k.t - start for k in supervised.kills]
    return FieldRun(policy, mtbf, steps, kills, supervised.events, supervised.of("done")[-1]["t"])


def forecast(run: FieldRun, *, trials: int = 1000, seed: int = 0) -> Forecast:
    """Simulate ``run`` from its own measurements: its kill times, and Poisson failures at its MTBF."""
    committed = run.of("committed")
    # the run's policy saw each stall less its one-time setup (SaveStats.recurring_stall); a process
    # pays the setup once, as it pays its restart
    setups = [e.get("setup", 0.0) for e in committed]
    recurring = [e["stall"] - setup for e, setup in zip(committed, setups, strict=True)]
    stall = float(np.mean(recurring)) if committed else 0.0
    persist = float(np.mean([e["persist"] for e in committed])) if committed else 0.0
    restarts = run.restarts
    restart = float(np.mean(restarts)) + sum(setups) / len(restarts) if restarts else 0.0
    profile = Profile(run.curve, run.step_time, stall, persist, restart)
    policy = policy_from_name(run.policy, mtbf=run.mtbf)
    end = FixedSteps(run.steps)
    kills = tuple(k for k in run.kills if k > 0)
    same = simulate(policy, profile, Trace(kills, randomize=False), end, trials=1, name=run.policy)
    poisson = simulate(policy, profile, Exponential(run.mtbf), end, trials=trials, seed=seed, name=run.policy)
    return Forecast(same, poisson, profile)
