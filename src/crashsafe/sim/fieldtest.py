"""End-to-end check of the simulator: real training, real SIGKILLs on a Poisson schedule, vs forecast.

:func:`run_field` trains the digits CNN (``crashsafe.sim.fieldtrainer``) under one policy while a
supervisor SIGKILLs it at exponentially distributed wall-clock gaps (seeded) and restarts it at once;
it measures wall time, lost steps, checkpoint costs and restart times. :func:`forecast` feeds those
measurements (the run's own loss curve, step time, stall, persist, restart) to the simulator, twice:
replaying the very kill times of the run (one deterministic trial), and under Poisson failures of
the same MTBF (many trials, giving the spread a single run should fall in).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from crashsafe.policies.names import policy_from_name
from crashsafe.sim.curve import LossCurve
from crashsafe.sim.endrules import FixedSteps
from crashsafe.sim.failures import Exponential, Trace
from crashsafe.sim.profile import Profile
from crashsafe.sim.result import SimResult
from crashsafe.sim.simulate import simulate

__all__ = ["FieldRun", "Forecast", "forecast", "run_field"]


@dataclass
class FieldRun:
    """What happened in one supervised run (times in seconds from the start of training)."""

    policy: str
    mtbf: float
    steps: int
    kills: list[float] = field(default_factory=list)  # kill times
    events: list[dict[str, Any]] = field(default_factory=list)
    wall: float = 0.0  # training start to done

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]

    @property
    def lost_steps(self) -> int:
        """Steps trained but not committed before a kill, so trained again after the restart."""
        lost, reached = 0, 0
        for e in self.events:
            if e["event"] == "step":
                reached = max(reached, e["step"])
            elif e["event"] == "start" and e["t"] > self.events[0]["t"]:
                lost += max(0, reached - e["resumed_from"])
                reached = e["resumed_from"]
        return lost

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


def _launch(
    work: Path, policy: str, mtbf: float, steps: int, seed: int, ballast_mb: float
) -> subprocess.Popen[bytes]:
    src = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "crashsafe.sim.fieldtrainer", "--dir", str(work / "ckpt"),
           "--log", str(work / "events.jsonl"), "--policy", policy, "--mtbf", repr(mtbf),
           "--steps", str(steps), "--seed", str(seed), "--ballast-mb", repr(ballast_mb)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=_die_with_parent if sys.platform == "linux" else None)


def _die_with_parent() -> None:
    """In the child: get SIGKILL if the supervisor dies, so no trainer outlives an interrupted run."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


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
    slow, e.g. on a loaded machine); the forecast replays exactly the kills that happened.
    """
    work.mkdir(parents=True, exist_ok=True)
    log = work / "events.jsonl"
    log.touch()
    rng = np.random.default_rng(kill_seed)
    run = FieldRun(policy, mtbf, steps)
    proc = _launch(work, policy, mtbf, steps, 0, ballast_mb)
    offset, start, next_kill = 0, None, None
    deadline = time.time() + timeout
    try:
        while True:
            with log.open("rb") as handle:  # read only what is new (a torn last line waits)
                handle.seek(offset)
                chunk = handle.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            offset += len(complete)
            for line in complete.splitlines():
                try:
                    run.events.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # the line a kill tore
                if start is None and run.events[-1]["event"] == "step":
                    start = run.events[-1]["t"]
                    next_kill = start + rng.exponential(mtbf)
            if run.events and run.events[-1]["event"] == "done":
                proc.wait()
                break
            now = time.time()
            more = max_kills is None or len(run.kills) < max_kills
            if next_kill is not None and now >= next_kill and more:
                proc.send_signal(signal.SIGKILL)
                run.kills.append(time.time())
                proc.wait()
                if proc.stderr:
                    proc.stderr.close()
                next_kill += rng.exponential(mtbf)
                with log.open("ab") as handle:  # end a line torn by the kill
                    handle.write(b"\n")
                proc = _launch(work, policy, mtbf, steps, 0, ballast_mb)
            elif proc.poll() is not None and proc.returncode != 0:
                stderr = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"the field trainer failed (exit {proc.returncode}):\n{stderr}")
            if now > deadline:
                raise TimeoutError(f"the field run of {policy} did not finish in {timeout:.0f} s")
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr:
            proc.stderr.close()
    assert start is not None
    run.wall = run.events[-1]["t"] - start
    run.kills = [k - start for k in run.kills]
    for e in run.events:
        e["t"] -= start
        if "spawned" in e:
            e["spawned"] -= start
    return run


def forecast(run: FieldRun, *, trials: int = 1000, seed: int = 0) -> Forecast:
    """Simulate ``run`` from its own measurements: its kill times, and Poisson failures at its MTBF."""
    committed = run.of("committed")
    stall = float(np.mean([e["stall"] for e in committed])) if committed else 0.0
    persist = float(np.mean([e["persist"] for e in committed])) if committed else 0.0
    restarts = run.restarts
    restart = float(np.mean(restarts)) if restarts else 0.0
    profile = Profile(run.curve, run.step_time, stall, persist, restart)
    policy = policy_from_name(run.policy, mtbf=run.mtbf)
    end = FixedSteps(run.steps)
    kills = tuple(k for k in run.kills if k > 0)
    same = simulate(policy, profile, Trace(kills, randomize=False), end, trials=1, name=run.policy)
    poisson = simulate(policy, profile, Exponential(run.mtbf), end, trials=trials, seed=seed, name=run.policy)
    return Forecast(same, poisson, profile)
