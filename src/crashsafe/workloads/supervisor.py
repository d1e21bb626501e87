"""Kill-and-resume runs: a trainer in a child process, SIGKILLed at chosen moments and restarted.

:func:`supervise` starts the trainer's command, follows the events it logs (:mod:`.eventlog`), asks a
:class:`KillPlan` at every poll whether to kill it now, and after each SIGKILL starts it again at once
(the trainer resumes from its newest checkpoint). Two plans: :class:`AtSteps` (``crashsafe demo``:
when training reaches chosen steps, after a chosen delay) and :class:`PoissonKills` (the field test:
exponentially distributed wall-clock gaps). Children die with the supervisor, and their stderr goes
to a log file, so the terminal shows only what the caller prints.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from crashsafe.workloads.eventlog import Event, EventTail, lost_steps, of_kind

__all__ = ["AtSteps", "Kill", "KillPlan", "KillRun", "PoissonKills", "spawn", "supervise"]

_POLL = 0.002  # seconds between looks at the event log


@dataclass(frozen=True)
class Kill:
    """One SIGKILL: its wall time, and the newest step the killed process had reached (None if it
    was killed before it logged ``start``)."""

    t: float
    step: int | None


@dataclass
class KillRun:
    """What a supervised run did: the trainer's events in log order, the kills, the restarts."""

    events: list[Event] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    restarts: int = 0
    wall: float = 0.0  # seconds from the first launch to the end of the last process
    reached: int = 0  # the newest step any process of the run has logged
    training_start: float | None = None  # wall time of the run's first trained step
    _steps: dict[int, int] = field(default_factory=dict, init=False, repr=False)  # pid -> newest step
    _done: set[int] = field(default_factory=set, init=False, repr=False)

    def of(self, kind: str) -> list[Event]:
        """The events of one kind, in log order."""
        return of_kind(self.events, kind)

    @property
    def lost_steps(self) -> int:
        """Steps trained but not committed before a kill, so trained again after the restart."""
        return lost_steps(self.events)

    def add(self, events: Sequence[Event]) -> None:
        """Take in events as the trainer logs them."""
        for e in events:
            self.events.append(e)
            if e["event"] == "start":
                self._steps[e["pid"]] = e["resumed_from"] or 0
            elif e["event"] == "step":
                self._steps[e["pid"]] = e["step"]
                self.reached = max(self.reached, e["step"])
                if self.training_start is None:
                    self.training_start = e["t"]
            elif e["event"] == "done":
                self._done.add(e["pid"])

    def started(self, pid: int) -> bool:
        """Whether process ``pid`` has restored its state and logged ``start``."""
        return pid in self._steps

    def step_of(self, pid: int) -> int | None:
        """The newest step process ``pid`` has reached (the one it resumed from before it trains)."""
        return self._steps.get(pid)

    def finished(self, pid: int) -> bool:
        """Whether process ``pid`` has logged ``done`` (it is closing; killing it would undo nothing)."""
        return pid in self._done


class KillPlan(Protocol):
    """When to SIGKILL the trainer."""

    def due(self, run: KillRun, pid: int, now: float) -> bool:
        """Whether to kill the trainer process ``pid`` at wall time ``now``, given the run so far."""
        ...


class AtSteps:
    """Kill when the run has reached each of ``steps`` (and the current process has started), the
    k-th kill ``delays[k]`` seconds later, so kills land mid-step, mid-snapshot or mid-commit.

    Steps count for the whole run: a restart that resumes below a step its killed predecessor had
    already reached is killed once it has started (after its delay).
    """

    def __init__(self, steps: Sequence[int], delays: Sequence[float]) -> None:
        if len(delays) != len(steps):
            raise ValueError(f"one delay per step: {len(steps)} steps, {len(delays)} delays")
        self.steps, self.delays = sorted(steps), list(delays)
        self._reached_at: dict[int, float] = {}  # kill index -> when its step was first seen reached

    def due(self, run: KillRun, pid: int, now: float) -> bool:
        k = len(run.kills)
        if k >= len(self.steps) or run.reached < self.steps[k] or not run.started(pid):
            return False
        return now >= self._reached_at.setdefault(k, now) + self.delays[k]


class PoissonKills:
    """Kill at exponentially distributed wall-clock gaps of mean ``mtbf`` seconds (drawn from
    ``seed``), counted from the run's first trained step; at most ``max_kills`` kills.

    A kill falls due on its schedule even while a restart is still starting up, as a real failure would.
    """

    def __init__(self, mtbf: float, seed: int, max_kills: int | None = None) -> None:
        self.mtbf, self.max_kills = mtbf, max_kills
        self._rng = np.random.default_rng(seed)
        self._times: list[float] = []  # wall times of the kills, drawn as they are needed

    def due(self, run: KillRun, pid: int, now: float) -> bool:
        k = len(run.kills)
        if run.training_start is None or (self.max_kills is not None and k >= self.max_kills):
            return False
        while len(self._times) <= k:
            previous = self._times[-1] if self._times else run.training_start
            self._times.append(previous + float(self._rng.exponential(self.mtbf)))
        return now >= self._times[k]


def spawn(cmd: Sequence[str], stderr: Path) -> subprocess.Popen[bytes]:
    """Start ``cmd`` with stdout discarded and stderr appended to the file ``stderr``.

    The child imports this very crashsafe (its source directory leads ``PYTHONPATH``), writes
    unbuffered, and on Linux gets SIGKILL if this process dies, so no trainer outlives its supervisor.
    """
    paths = [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    with stderr.open("ab") as errors:
        return subprocess.Popen(
            list(cmd),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=errors,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )


def _die_with_parent() -> None:
    """In the child: ask the kernel for SIGKILL when the parent dies (PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def supervise(
    cmd: Sequence[str],
    events: Path,
    plan: KillPlan,
    *,
    stderr: Path,
    name: str = "the trainer",
    timeout: float = 600.0,
    on_step: Callable[[int], None] | None = None,
) -> KillRun:
    """Run the trainer ``cmd`` (logging to ``events``) to its end, SIGKILLing it whenever ``plan``
    says and restarting it at once; ``on_step`` hears each newly reached step.

    The trainer's stderr is appended to ``stderr``. Raises RuntimeError (with the end of that log) if
    the trainer fails, TimeoutError if the run takes longer than ``timeout`` seconds.
    """
    tail = EventTail(events)
    run = KillRun()
    began = time.perf_counter()
    proc = spawn(cmd, stderr)
    try:
        while True:
            exited = proc.poll() is not None
            _follow(run, tail, on_step)
            if exited:
                break
            if not run.finished(proc.pid) and plan.due(run, proc.pid, time.time()):
                proc.send_signal(signal.SIGKILL)
                killed_at = time.time()
                if proc.wait() != -signal.SIGKILL:
                    continue  # it ended by itself just before: the next look sees how
                _follow(run, tail, on_step)
                run.kills.append(Kill(killed_at, run.step_of(proc.pid)))
                tail.end_torn_line()
                run.restarts += 1
                proc = spawn(cmd, stderr)
            elif time.perf_counter() - began > timeout:
                raise TimeoutError(f"{name} did not finish in {timeout:.0f} s (its stderr: {stderr})")
            time.sleep(_POLL)
        if proc.returncode != 0:
            end = _end(stderr)
            raise RuntimeError(f"{name} failed (exit {proc.returncode}); the end of {stderr}:\n{end}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    run.wall = time.perf_counter() - began
    return run


def _follow(run: KillRun, tail: EventTail, on_step: Callable[[int], None] | None) -> None:
    before = run.reached
    run.add(tail.read())
    if on_step is not None and run.reached > before:
        on_step(run.reached)


def _end(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
