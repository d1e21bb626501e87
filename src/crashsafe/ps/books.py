"""What one run of a parameter-server job keeps track of, created fresh by every ``PSJob.run``.

The driver's clock loop and recovery read and write these records; the books themselves never
talk to an actor, so what a run counts (updates pushed, bytes, recoveries) is plain bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from crashsafe.ps.config import Failure
from crashsafe.ps.messages import nbytes
from crashsafe.ps.result import Recovery, RunResult

__all__ = ["RunBooks"]

Clock = tuple[int, int]  # (worker, clock)


def _empty_result() -> RunResult:
    return RunResult(params={}, clocks=0, seconds=0.0, updates_pushed=0, updates_applied=0)


@dataclass
class RunBooks:
    """The state of one run. Clocks are numbered from 0; -1 means "none yet"."""

    result: RunResult = field(default_factory=_empty_result)
    failures: list[Failure] = field(default_factory=list)  # still to inject, by clock
    ended: list[int] = field(default_factory=list)  # per server: the last clock it ended
    expected: list[NDArray[np.int32]] = field(default_factory=list)  # per server: updates per block then
    completed: int = -1  # the last clock every server ended
    ack: int = -1  # workers may drop their updates of clocks <= ack
    pending: dict[int, list[Any]] = field(default_factory=dict)  # replicas riding on a worker's next clock
    pushed: dict[Clock, int] = field(default_factory=dict)  # block updates per worker clock, counted once
    computed: set[Clock] = field(default_factory=set)
    clock_losses: dict[int, list[float]] = field(default_factory=dict)
    open: list[tuple[Recovery, float, int]] = field(default_factory=list)  # (event, start, clock to reach)
    kill_time: float | None = None  # when the last injected failure struck (until its recovery)
    relaunch_seconds: float = float("nan")  # of the workers that failure killed
    relaunched: set[int] = field(default_factory=set)  # workers relaunched since the last recovery
    inflight: dict[Any, Clock] = field(default_factory=dict)  # SSP: running clock calls by reference
    done: list[int] = field(default_factory=list)  # SSP: each worker's last finished clock

    @classmethod
    def start(cls, clocks: int, failures: list[Failure], ranges: list[tuple[int, int]]) -> RunBooks:
        """The books of a run of ``clocks`` clocks over servers holding block ``ranges``."""
        return cls(
            result=RunResult(params={}, clocks=clocks, seconds=0.0, updates_pushed=0, updates_applied=0),
            failures=sorted(failures, key=lambda f: f.clock),
            ended=[-1] * len(ranges),
            expected=[np.zeros(hi - lo, np.int32) for lo, hi in ranges],
        )

    def book_clock(self, w: int, clock: int, out: dict[str, Any]) -> bool:
        """Book worker ``w``'s result of ``clock``; return True if a server looked unavailable."""
        if out["status"] != "ok":
            return True
        res = self.result
        if (w, clock) in self.computed:
            res.worker_reruns += 1
        self.computed.add((w, clock))
        self.pushed.setdefault((w, clock), out["updates"])
        self.clock_losses.setdefault(clock, []).append(out["loss"])
        res.pull_bytes += out["pull_bytes"]
        res.push_bytes += out["push_bytes"]
        res.ft_pull_bytes += out["ft_pull_bytes"]
        return bool(out["failed"])

    def book_end(self, s: int, clock: int, out: dict[str, Any]) -> None:
        """Book server ``s`` ending ``clock``: queue its replica copies, note its update counts."""
        for w, copy in out["replicas"].items():  # they ride on w's next clock (or a flush)
            self.pending.setdefault(w, []).append(copy)
            self.result.replica_bytes += nbytes(copy)
        self.ended[s] = clock
        self.expected[s][out["changed"]] = out["counts"]
        self.result.version_bytes += int(out["changed"].nbytes + out["counts"].nbytes)

    def open_recovery(self, event: Recovery, begin: float) -> None:
        """A recovery that started at ``begin``; it closes once the job is back where it is now."""
        self.open.append((event, begin, self.completed))

    def close_recoveries(self, now: float) -> bool:
        """Stamp and record the recoveries the job has caught up from; True once none is open."""
        for item in list(self.open):
            event, begin, target = item
            if self.completed >= target:
                event.seconds = now - begin
                self.result.recoveries.append(event)
                self.open.remove(item)
        return not self.open

    def discarded(self, resume: int) -> int:
        """Block updates applied for clocks from ``resume`` on, which a rollback to it throws away."""
        return sum(n for (_, t), n in self.pushed.items() if resume <= t <= self.completed)

    def rewind(self, resume: int, counts: list[NDArray[np.int32]], lag: int) -> None:
        """Every server back at the end of clock ``resume - 1`` with update ``counts``; nothing pending."""
        self.ended = [resume - 1] * len(self.ended)
        self.expected = [np.array(c, np.int32) for c in counts]  # ray.get gives read-only arrays
        self.completed, self.ack, self.pending = resume - 1, resume - 1 - lag, {}

    def finish(self) -> None:
        """Total what the workers pushed and the mean loss of every clock."""
        self.result.updates_pushed = sum(self.pushed.values())
        self.result.losses = [float(np.mean(self.clock_losses[t])) for t in sorted(self.clock_losses)]
