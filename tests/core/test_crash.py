"""Crash consistency, tested by really killing processes: random SIGKILLs while saving, and a
SIGKILL after each step of the commit protocol."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import crashsafe as cs
from crashsafe._faults import COMMIT_POINTS
from crashsafe.storage.layout import committed_steps


def _check_every_step_intact(directory: Path) -> list[int]:
    report = cs.verify(directory)
    assert report.ok, [s.problem for s in report.damaged]
    reader = cs.CheckpointManager(directory, read_only=True)
    for step in report.intact:
        state = reader.load(step)
        assert state["step"] == step
        assert np.all(state["a"] == step)
        assert np.array_equal(state["b"]["ints"], np.arange(1 << 14) * step)
        assert state["b"]["name"] == f"step{step}"
    return report.intact


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_random_sigkills_never_damage_committed_steps(
    tmp_path: Path, mode: str, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    """25 trials per mode (50 in all): kill the saving process at a random instant, then check."""
    rng = random.Random(1234 if mode == "async" else 5678)
    directory = tmp_path / "ckpt"
    seen_steps: set[int] = set()
    for _ in range(25):
        proc = spawn("writer_loop.py", directory, mode, 2)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.stderr else ""
        before = set(committed_steps(directory))
        time.sleep(rng.uniform(0.0, 0.25))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()
        assert proc.returncode == -signal.SIGKILL
        intact = _check_every_step_intact(directory)
        # retention keeps the newest 2: the newest step committed before this trial survives
        if before:
            assert max(intact) >= max(before)
        seen_steps.update(intact)
    assert len(seen_steps) > 10  # the trials really saved many steps
    cs.CheckpointManager(directory).close()  # next writer cleans leftovers
    assert not [p for p in directory.iterdir() if p.name.startswith((".tmp-", ".trash-"))]


@pytest.mark.parametrize("point", COMMIT_POINTS)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_sigkill_at_each_commit_step(tmp_path: Path, run_child: object, point: str, mode: str) -> None:
    directory = tmp_path / "ckpt"
    result = run_child("fault_point.py", directory, point, mode)  # type: ignore[operator]
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert "survived" not in result.stdout
    steps = committed_steps(directory)
    committed_new = COMMIT_POINTS.index(point) >= COMMIT_POINTS.index("after_rename")
    if committed_new:
        assert 2 in steps
    else:
        assert steps == [1]
    report = cs.verify(directory)
    assert report.ok, report.damaged
    reader = cs.CheckpointManager(directory, read_only=True)
    for step in steps:
        assert np.all(reader.load(step)["x"] == float(step))
    assert reader.load()["step"] == max(steps)
    # the next writer removes leftovers and carries on
    with cs.CheckpointManager(directory, keep_last=1) as mgr:
        mgr.save(3, {"x": np.full(1000, 3.0), "y": np.arange(10) * 3, "step": 3})
    assert committed_steps(directory) == [3]
    assert sorted(p.name for p in directory.iterdir()) == [".lock", "step_000000000003"]
