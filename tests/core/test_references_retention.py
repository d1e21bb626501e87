"""Retention of steps that refer to earlier steps' bytes: a kept step's referenced step is never
deleted, and a deletion SIGKILLed at any point (steps go newest first, so a step always goes before
the step it refers to) strands no step, on a local directory and on an object store (file://)."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crashsafe as cs
from crashsafe.chain import doomed_steps, protected_steps
from crashsafe.policies.keep import KeepLast
from crashsafe.storage.stores import open_store

from ..refsteps import commit_references
from .conftest import child_env

STEPS = 16  # a full save every 4th step; the steps between refer to its w and own their n
NEWEST_FIRST = [13, *range(11, -1, -1)]  # what gc --keep-last 2 deletes, in its order


def _state(step: int) -> dict[str, Any]:
    return {"w": np.full(256, float(step - step % 4)), "n": np.arange(32) * step, "step": step}


def _every_step_loads(location: str) -> list[int]:
    report = cs.verify(location)
    assert report.ok, [d.problem for d in report.damaged]
    reader = cs.CheckpointManager(location, read_only=True)
    for step in report.intact:
        state = reader.load(step)
        assert state["step"] == step and np.all(state["w"] == float(step - step % 4))
        assert np.array_equal(state["n"], np.arange(32) * step)
    return report.intact


def _make(location: str) -> None:
    for step in range(STEPS):
        if step % 4 == 0:
            with cs.CheckpointManager(location, keep_last=None, async_save=False) as mgr:
                mgr.save(step, _state(step))
        else:
            commit_references(location, step, step - 1, {"n": _state(step)["n"]})


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The run on a local directory and on the object-store protocol over a local one."""
    made = {}
    for kind in ("local", "file"):
        directory = tmp_path_factory.mktemp(kind) / "template"
        _make(str(directory) if kind == "local" else f"file://{directory}")
        made[kind] = directory
    return made


def test_retention_keeps_every_step_a_kept_step_refers_to(templates: dict[str, Path]) -> None:
    store = open_store(templates["local"])
    try:
        assert protected_steps(store, [14, 15]) == {12}
        assert protected_steps(store, [3]) == {0}
        assert doomed_steps(store, KeepLast(2)) == [*range(12), 13]
    finally:
        store.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["local", "file"])
def test_sigkill_during_gc_never_strands_a_reference(
    tmp_path: Path, templates: dict[str, Path], kind: str
) -> None:
    """gc --keep-last 2 keeps 14 and 15 and step 12, whose w they refer to, and deletes the 13
    others. Kill it for real at a random one of its deletions, at both points of the deletion
    protocol: every step left verifies and loads; the next gc finishes the job."""
    rng = random.Random(29 if kind == "local" else 31)
    points = ("after_unlink_manifest" if kind == "file" else "after_trash_rename", "mid_delete")
    for point in points:
        for nth in rng.sample(range(1, 14), 2):
            directory = tmp_path / f"{point}-{nth}"
            subprocess.run(["cp", "-a", str(templates[kind]), str(directory)], check=True)
            location = str(directory) if kind == "local" else f"file://{directory}"
            result = subprocess.run(
                [sys.executable, "-m", "crashsafe.cli", "gc", location, "--keep-last", "2"],
                env=child_env(CRASHSAFE_KILL_AT=f"{point}:{nth}"),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert result.returncode == -signal.SIGKILL, (point, nth, result.stderr)
            left = _every_step_loads(location)
            assert {12, 14, 15} <= set(left) and len(left) < STEPS, (point, nth, left)
            gone = sorted(set(range(STEPS)) - set(left))
            assert gone in (sorted(NEWEST_FIRST[: nth - 1]), sorted(NEWEST_FIRST[:nth])), (point, nth, gone)
            with cs.CheckpointManager(location, keep_last=2) as mgr:
                mgr.gc()
            assert _every_step_loads(location) == [12, 14, 15]
