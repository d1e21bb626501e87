"""Many processes, one checkpoint: real DDP and FSDP2 jobs on gloo (127.0.0.1), killed for real and
resumed; resharding; damage that makes every rank fall back; a rank dying mid-commit."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crashsafe as cs


def _run(launch: Any, kind: str, world: int, directory: Path, out: Path, steps: int = 12, *more: Any) -> None:
    codes = launch("job.py", world, kind, directory, steps, 3, out, 60, *more).wait()
    assert codes == [0] * world, codes


def _same(a: Path, b: Path) -> None:
    with np.load(a) as left, np.load(b) as right:
        assert sorted(left.files) == sorted(right.files)
        for name in left.files:
            assert np.array_equal(left[name], right[name]), name


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_save_and_resume_with_two_ranks(tmp_path: Path, launch: Any, kind: str) -> None:
    """Run 12 steps straight; run 6, rebuild everything, resume to 12: the end is bit-identical.
    DDP's replicated state is written once; FSDP2's shards once each."""
    _run(launch, kind, 2, tmp_path / "straight", tmp_path / "straight.npz")
    _run(launch, kind, 2, tmp_path / "resumed", tmp_path / "resumed.npz", 12, 6)
    _same(tmp_path / "straight.npz", tmp_path / "resumed.npz")
    reader = cs.CheckpointManager(tmp_path / "resumed", read_only=True)
    manifest = reader.manifest()
    assert manifest.world == 2 and {p.rank for p in manifest.payloads} == {0, 1}
    if kind == "ddp":  # every replicated array once: only RNG states, which may differ, twice
        paths = [p.path for p in manifest.payloads]
        assert all(paths.count(p) == 1 for p in paths if p.startswith(("model.", "optim.")))
        assert {p for p in paths if paths.count(p) > 1} <= {p for p in paths if p.startswith("rng.")}
    else:  # every parameter and moment in two shards, one per rank
        shards = [p for p in manifest.payloads if p.shard is not None]
        assert shards and all(sum(q.path == p.path for q in shards) == 2 for p in shards)
    full = reader.load()  # one plain process: whole tensors under the model's names
    with np.load(tmp_path / "resumed.npz") as final:
        for name, tensor in full["model"].items():
            assert np.array_equal(tensor.numpy(), final[f"model.{name}"]), name
    assert cs.verify(tmp_path / "resumed").ok


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_at_random_moments_then_resume_bit_identically(tmp_path: Path, launch: Any) -> None:
    """FSDP2 on 2 ranks, killed for real at random moments of training and saving: once every rank,
    once one rank (the other then fails within the coordination timeout, never hangs). Every
    committed step verifies, and the job resumed to the end is bit-identical to an uninterrupted one."""
    kind, steps = "fsdp", 60
    _run(launch, kind, 2, tmp_path / "straight", tmp_path / "straight.npz", steps)
    rng = random.Random(3)
    directory = tmp_path / "killed"
    for victims in (None, [1]):
        ranks = launch("job.py", 2, kind, directory, steps, 3, tmp_path / "unused.npz", 10)
        first = ranks.procs[0][0].stdout
        assert first is not None and first.readline().startswith("resumed")
        time.sleep(rng.uniform(0.5, 1.5))
        ranks.kill(victims)
        started = time.monotonic()
        codes = ranks.wait(60)
        assert all(code != 0 for code in codes) and time.monotonic() - started < 30
        report = cs.verify(directory)
        assert report.ok, [d.problem for d in report.damaged]
    final = launch("job.py", 2, kind, directory, steps, 3, tmp_path / "killed.npz", 60)
    resumed = final.procs[0][0].stdout
    assert resumed is not None and int(resumed.readline().split()[1]) > 0  # it really resumed
    assert final.wait() == [0, 0]
    _same(tmp_path / "straight.npz", tmp_path / "killed.npz")
