"""The kill-and-resume supervisor and its event log, on a trainer without torch (fast)."""

from __future__ import annotations

import sys
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from crashsafe.manager import CheckpointManager
from crashsafe.workloads.eventlog import EventLog, EventTail, lost_steps
from crashsafe.workloads.supervisor import AtSteps, Kill, KillRun, PoissonKills, supervise

TRAINER = Path(__file__).parent / "scripts" / "counting_trainer.py"


def _cmd(work: Path, steps: int | str, pause: float = 0.005) -> list[str]:
    return [sys.executable, str(TRAINER), str(work / "ckpt"), str(work / "events.jsonl"), str(steps),
            str(pause)]


def _event(kind: str, pid: int, **fields: Any) -> dict[str, Any]:
    return {"event": kind, "pid": pid, "t": 0.0, **fields}


def test_lost_steps_counts_what_each_killed_process_trained_past_its_resume_point() -> None:
    events = [_event("start", 1, resumed_from=None)]
    events += [_event("step", 1, step=s) for s in range(1, 51)]  # killed at 50; 40 was committed
    events += [_event("start", 2, resumed_from=40)]
    events += [_event("step", 2, step=s) for s in range(41, 46)]  # killed at 45 before committing more
    events += [_event("start", 3, resumed_from=40)]  # a process killed while starting logs nothing
    events += [_event("start", 4, resumed_from=40)]
    events += [_event("step", 4, step=s) for s in range(41, 61)] + [_event("done", 4, step=60)]
    assert lost_steps(events) == 10 + 5
    run = KillRun()
    run.add(events)
    assert run.lost_steps == 15 and run.reached == 60 and run.step_of(2) == 45 and run.step_of(3) == 40
    assert run.started(3) and not run.started(5) and run.finished(4) and not run.finished(2)


def test_the_tail_skips_a_line_torn_by_a_kill(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    tail = EventTail(path)
    with closing(EventLog(path)) as log:
        log.emit("start", resumed_from=None)
    with path.open("a") as handle:
        handle.write('{"pid": 1, "t": 2.0, "event": "st')  # the writer died here
    assert [e["event"] for e in tail.read()] == ["start"]
    assert tail.read() == []  # the torn line waits for its end
    tail.end_torn_line()
    with closing(EventLog(path)) as log:
        log.emit("step", step=1, loss=0.5)
    assert [e["event"] for e in tail.read()] == ["step"]


def test_poisson_kills_follow_the_seeded_gaps_from_the_first_step() -> None:
    plan = PoissonKills(mtbf=2.0, seed=3, max_kills=2)
    run = KillRun()
    assert not plan.due(run, 1, 1e9)  # nothing trained yet: the clock has not started
    run.add([_event("start", 1, resumed_from=None), {**_event("step", 1, step=1), "t": 100.0}])
    first, second = 100.0 + np.cumsum(np.random.default_rng(3).exponential(2.0, 2))
    assert not plan.due(run, 1, first - 1e-6) and plan.due(run, 1, first)
    run.kills.append(Kill(first, 1))
    assert not plan.due(run, 2, second - 1e-6) and plan.due(run, 2, second)  # even while starting up
    run.kills.append(Kill(second, None))
    assert not plan.due(run, 3, 1e9)  # max_kills reached


@pytest.mark.timeout(120)
def test_supervise_kills_at_the_steps_restarts_and_the_run_completes(tmp_path: Path) -> None:
    reached: list[int] = []
    run = supervise(_cmd(tmp_path, 60), tmp_path / "events.jsonl", AtSteps([12, 33], [0.0, 0.01]),
                    stderr=tmp_path / "trainer.log", timeout=100, on_step=reached.append)
    assert len(run.kills) == 2 and run.restarts == 2
    killed_at = [k.step or 0 for k in run.kills]
    assert killed_at[0] >= 12 and killed_at[1] >= 33
    starts = run.of("start")
    assert starts[0]["resumed_from"] is None and all(s["resumed_from"] for s in starts[1:])
    resumed = [s["resumed_from"] for s in starts[1:]]
    assert run.of("done")[-1]["step"] == 60 and run.of("done")[-1]["w"] == 60.0  # resumed, not restarted
    assert reached == sorted(reached) and reached[-1] == 60
    assert run.lost_steps == sum(k - r for k, r in zip(killed_at, resumed, strict=True)) > 0
    assert CheckpointManager(tmp_path / "ckpt", read_only=True).steps()[-1] == 60


def test_a_failing_trainer_is_reported_with_its_stderr(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"(?s)exit 3.*this trainer cannot train"):
        supervise(_cmd(tmp_path, "fail"), tmp_path / "events.jsonl", AtSteps([], []),
                  stderr=tmp_path / "trainer.log", name="the counting trainer")


def test_a_trainer_that_does_not_finish_in_time_is_stopped(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match="did not finish in 1 s"):
        supervise(_cmd(tmp_path, 10_000, pause=0.05), tmp_path / "events.jsonl", AtSteps([], []),
                  stderr=tmp_path / "trainer.log", timeout=1.0)
