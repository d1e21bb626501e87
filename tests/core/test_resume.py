"""Exact resume, SIGTERM preemption and bounded memory, each by running real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import xxhash

import crashsafe as cs
from crashsafe.cli.demo import compare_final, run_supervised


@pytest.mark.timeout(300)
def test_killed_and_resumed_training_is_bit_identical(tmp_path: Path) -> None:
    """The digits CNN, SIGKILLed twice at random moments, ends bit-identical to a clean run."""
    steps, every = 120, 10
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    killed.mkdir()
    reference = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "crashsafe.workloads.digits",
            "--dir",
            str(clean / "ckpt"),
            "--steps",
            str(steps),
            "--every",
            str(every),
            "--log",
            str(tmp_path / "clean.jsonl"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    result = run_supervised(killed, steps=steps, every=every, kills=2, seed=7)
    _, err = reference.communicate(timeout=240)
    assert reference.returncode == 0, err.decode()
    assert len(result.kills) == 2 and result.restarts == 2
    starts = result.of("start")
    assert starts[0]["resumed_from"] is None
    assert all(s["resumed_from"] is not None for s in starts[1:])  # each restart resumed
    same, worst, count = compare_final(killed / "ckpt", clean / "ckpt")
    assert same, f"resumed run differs (max abs diff {worst})"
    assert count > 10
    # each restart resumed from at least the newest step known committed before its kill
    for start in starts[1:]:
        logged = [e["step"] for e in result.of("committed") if e["t"] < start["t"]]
        assert start["resumed_from"] >= max(logged, default=0)


@pytest.mark.timeout(120)
def test_sigterm_commits_a_final_checkpoint_then_exits(
    tmp_path: Path, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    proc = spawn("sigterm_train.py", tmp_path)
    assert proc.stdout is not None
    digests: dict[int, str] = {}
    for line in proc.stdout:
        _, step, digest = line.split()
        digests[int(step)] = digest
        if int(step) == 25:
            proc.send_signal(signal.SIGTERM)
            break
    rest, err = proc.communicate(timeout=60)
    for line in rest.splitlines():
        _, step, digest = line.split()
        digests[int(step)] = digest
    assert proc.returncode == 143, err
    mgr = cs.CheckpointManager(tmp_path, read_only=True)
    assert mgr.steps() == [max(digests)]  # policy never saved; SIGTERM did, at the last step
    state = mgr.load()
    weight = state["model"]["weight"]
    assert xxhash.xxh3_64_hexdigest(weight.numpy().tobytes()) == digests[state["step"]]
    assert cs.verify(tmp_path).ok


@pytest.mark.timeout(120)
def test_async_saves_use_about_one_extra_state_of_memory(
    tmp_path: Path, run_child: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    result = run_child("memory_peak.py", tmp_path, 256)
    assert result.returncode == 0, result.stderr
    extra, state_bytes = map(int, result.stdout.split())
    assert extra < 1.15 * state_bytes + (32 << 20), f"peak extra {extra / 2**20:.0f} MiB"


def test_training_loop_continues_while_persisting(tmp_path: Path) -> None:
    """save() returns after the snapshot; the commit happens later in the background."""
    state = {"w": torch.zeros(8_000_000)}
    with cs.CheckpointManager(tmp_path) as mgr:
        began = time.perf_counter()
        mgr.save(1, state)
        returned = time.perf_counter() - began
        pending_at_return = mgr.steps() == []
        mgr.wait()
        assert mgr.steps() == [1]
        persist = mgr.stats[-1].persist
    # behaviour, not speed: when the save returned, the step was not yet committed, or the
    # snapshot was far quicker than persisting.
    assert pending_at_return or returned < persist
    reader = cs.CheckpointManager(tmp_path, read_only=True)
    assert not reader.load(1)["w"].any()
