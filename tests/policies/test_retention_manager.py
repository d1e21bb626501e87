"""Keep policies in the CheckpointManager with a real model: the best steps by a validation loss and
their delta bases, best_step and restore(step="best"), what retention reads, `crashsafe gc --keep-best`,
and SIGKILLs in the middle of metric-driven deletions (by gc and after a training save)."""

from __future__ import annotations

import collections
import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import crashsafe as cs
import crashsafe.chain
import crashsafe.step_facts
from crashsafe.chain import direct_bases
from crashsafe.policies import (
    KeepBest,
    KeepEvery,
    KeepEveryInterval,
    KeepLast,
    KeepUnion,
    PolicyError,
    StepFacts,
)

from .retention_oracle import expected_kept

HERE = Path(__file__).parent
SRC = HERE.parent.parent / "src"
SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
DELTA = cs.codecs.Incremental(full_every=4)


@pytest.fixture
def fast_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(dir=SHM))
    yield path / "ckpt"
    shutil.rmtree(path)


def _history(directory: Path | str) -> tuple[list[int], dict[int, StepFacts], dict[int, set[int]]]:
    """The committed steps with their facts and delta bases, as the manifests say."""
    reader = cs.CheckpointManager(directory, read_only=True)
    steps = reader.steps()
    manifests = {s: reader.manifest(s) for s in steps}
    facts = {s: StepFacts(m.created, m.metrics) for s, m in manifests.items()}
    return steps, facts, {s: set(direct_bases(m)) for s, m in manifests.items()}


def _loads_and_verifies(directory: Path | str) -> list[int]:
    report = cs.verify(directory)
    assert report.ok, [d.problem for d in report.damaged]
    reader = cs.CheckpointManager(directory, read_only=True)
    for step in report.intact:
        assert reader.load(step)["step"] == step
    return report.intact


def _train(directory: Path, steps: int, keep: Any) -> dict[int, dict[str, torch.Tensor]]:
    """A real regression model trained with Adam; saves every step with its validation loss; returns
    each step's weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optim = torch.optim.Adam(model.parameters(), lr=0.05)
    x, xv = torch.randn(64, 8), torch.randn(32, 8)
    y, yv = x.sum(1, keepdim=True).sin(), xv.sum(1, keepdim=True).sin()
    weights = {}
    with cs.CheckpointManager(directory, keep=keep, codec={"model.*": DELTA}, async_save=False) as mgr:
        for step in range(30):
            optim.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optim.step()
            with torch.no_grad():
                val = torch.nn.functional.mse_loss(model(xv), yv).item() + 0.05 * (step % 4 == 0)  # noisy
            state = {"model": model, "optim": optim, "step": step}
            mgr.save(step, state, {"val_loss": val, "train_step": step})
            weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return weights


def test_a_real_run_keeps_its_best_steps_by_validation_loss_and_restores_the_best(tmp_path: Path) -> None:
    keep = KeepLast(2) | KeepBest(3, "val_loss")
    weights = _train(tmp_path, 30, keep)
    steps, facts, bases = _history(tmp_path)
    assert set(steps) == expected_kept(steps, facts, bases, keep, set())
    vals = {s: f.metrics["val_loss"] for s, f in facts.items()}
    best = min(vals, key=lambda s: (vals[s], -s))
    assert len([s for s in steps if s < 28]) >= 3  # best steps beside the newest two, with chains
    mgr = cs.CheckpointManager(tmp_path, read_only=True)
    assert mgr.best_step("val_loss") == best
    assert mgr.best_step("val_loss", "max") == max(vals, key=lambda s: (vals[s], s))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    live = {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=0.05), "step": -1}
    assert mgr.restore(live, step="best", metric="val_loss") == best
    assert live["step"] == best
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[best][name])
    assert mgr.load(step="best", metric="train_step", mode="max")["step"] == 29
    assert _loads_and_verifies(tmp_path) == steps


def test_keep_and_the_shorthands_agree_and_do_not_mix(fast_dir: Path) -> None:
    def run(directory: Path, **retention: Any) -> list[int]:
        with cs.CheckpointManager(directory, async_save=False, codec=DELTA, **retention) as mgr:
            for step in range(1, 14):
                mgr.save(step, {"w": np.full(4, float(step)), "step": step})
            return mgr.steps()

    shorthand = run(fast_dir / "a", keep_last=2, keep_every=5)
    assert shorthand == run(fast_dir / "b", keep=KeepLast(2) | KeepEvery(5))
    assert shorthand == run(fast_dir / "c", keep=[KeepLast(2), KeepEvery(5)]) == [5, 9, 10, 11, 12, 13]
    assert run(fast_dir / "d") == [9, 10, 11, 12, 13]  # the default keep_last=3, and the bases of 11
    with pytest.raises(PolicyError, match="either keep= or keep_last"):
        cs.CheckpointManager(fast_dir / "e", keep=KeepLast(1), keep_last=3)
    with pytest.raises(PolicyError, match="either mirror_keep= or mirror_keep_last"):
        cs.CheckpointManager(fast_dir / "e", mirror_keep=KeepLast(1), mirror_keep_every=3)
    with pytest.raises(PolicyError, match="keep= takes a keep policy"):
        cs.CheckpointManager(fast_dir / "e", keep=3)  # type: ignore[arg-type]


def test_steps_without_the_metric_are_kept_unless_dropped(fast_dir: Path) -> None:
    def run(directory: Path, missing: Any) -> list[int]:
        with cs.CheckpointManager(
            directory, keep=KeepBest(1, "val", missing=missing), async_save=False
        ) as mgr:
            for step in range(8):  # val at every 3rd save only, once NaN
                metrics = {"val": float("nan") if step == 6 else 8 - step} if step % 3 == 0 else {}
                mgr.save(step, {"step": step}, metrics)
            return mgr.steps()

    assert run(fast_dir / "keep", "keep") == [1, 2, 3, 4, 5, 6, 7]  # 0 ranked and beaten by 3
    assert run(fast_dir / "drop", "drop") == [3, 7]  # the best, and the newest


def test_keep_every_interval_keeps_one_step_per_interval_of_commit_time(fast_dir: Path) -> None:
    keep = KeepLast(1) | KeepEveryInterval(0.1)
    table: dict[int, StepFacts] = {}
    with cs.CheckpointManager(fast_dir, keep=keep, async_save=False) as mgr:
        for step in range(16):
            mgr.save(step, {"step": step})
            table[step] = StepFacts(mgr.manifest(step).created)  # the step just saved is kept
            time.sleep(0.03)
    kept = expected_kept(range(16), table, collections.defaultdict(set), keep, set())
    assert _loads_and_verifies(fast_dir) == sorted(kept) and len(kept) >= 4
    times = [table[s].created for s in sorted(kept)[:-1]]
    assert all(b - a >= 0.1 for a, b in itertools.pairwise(times))


def test_best_step_reads_the_tiers_and_names_what_is_recorded(fast_dir: Path) -> None:
    reader = cs.CheckpointManager(fast_dir.parent, read_only=True)
    assert reader.best_step("loss") is None  # no step at all
    assert reader.restore({"step": 0}, step="best", metric="loss") is None
    with cs.CheckpointManager(fast_dir, keep_last=None) as mgr:
        for step, loss in [(1, 0.5), (2, 0.2), (3, 0.2), (4, float("nan")), (5, 0.9)]:
            mgr.save(step, {"step": step}, {"loss": loss, "acc": step / 10})
        assert mgr.best_step("loss") == 3  # the pending save counts; ties go to the newer step
        assert mgr.best_step("loss", "max") == 5
        with pytest.raises(cs.NoCheckpointError, match=r"records the metric 'los'.*'acc', 'loss'"):
            mgr.best_step("los")
        with pytest.raises(PolicyError, match="mode must be 'min'"):
            mgr.best_step("loss", "lowest")  # type: ignore[arg-type]
        with pytest.raises(PolicyError, match="step='best' needs metric="):
            mgr.load(step="best")
        with pytest.raises(PolicyError, match="metric= picks the step for step='best' only"):
            mgr.load(step=2, metric="loss")
        with pytest.raises(PolicyError, match="None \\(the newest\\) or 'best', got 'latest'"):
            mgr.restore({"step": 0}, step="latest")
        for bad in (True, 1.0, -1, 2**63):  # True restored step 1; 1.0 failed inside a format string
            with pytest.raises(PolicyError, match=f"step must be an int .*, got {bad!r}"):
                mgr.restore({"step": 0}, step=bad)  # type: ignore[arg-type]
            with pytest.raises(PolicyError, match="step must be an int"):
                mgr.load(step=bad)  # type: ignore[arg-type]
    assert (
        cs.CheckpointManager(fast_dir, read_only=True).load(step="best", metric="acc", mode="max")["step"]
        == 5
    )


def test_retention_reads_each_manifest_once(fast_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Facts come from a manifest read once per step (then cached), none for a step the manager
    saved itself; a policy that looks only at step numbers reads none for facts; the read that gives
    a step's facts also gives its delta bases."""
    with cs.CheckpointManager(fast_dir, keep_last=None, async_save=False) as mgr:
        for step in range(20):
            mgr.save(step, {"step": step}, {"val": (step * 7) % 11})
    reads: collections.Counter[int] = collections.Counter()
    base_reads: collections.Counter[int] = collections.Counter()
    real = crashsafe.step_facts.read_manifest

    def counted(store: Any, step: int) -> Any:
        reads[step] += 1
        return real(store, step)

    def counted_bases(store: Any, step: int) -> Any:
        base_reads[step] += 1
        return real(store, step)

    monkeypatch.setattr(crashsafe.step_facts, "read_manifest", counted)
    monkeypatch.setattr(crashsafe.chain, "read_manifest", counted_bases)
    with cs.CheckpointManager(fast_dir, keep=KeepLast(2), async_save=False) as mgr:
        for step in range(20, 30):
            mgr.save(step, {"step": step}, {"val": (step * 7) % 11})
    assert not reads
    with cs.CheckpointManager(fast_dir, keep_last=None, async_save=False) as mgr:
        for step in range(30, 40):
            mgr.save(step, {"step": step}, {"val": (step * 7) % 11})
    with cs.CheckpointManager(fast_dir, keep=KeepLast(2) | KeepBest(3, "val"), async_save=False) as mgr:
        for step in range(40, 60):
            mgr.save(step, {"step": step}, {"val": (step * 7) % 11})
        mgr.gc()
    # the steps found at opening are read once; the manager's own saves give their facts unread
    assert set(reads) == set(range(28, 40)) and set(reads.values()) == {1}
    assert not set(base_reads) & set(range(30, 60))  # read for their facts (28, 29: for bases before)


# ----------------------------------------------------------------------------- the command line


def _scored_run(directory: Path | str, steps: int = 16) -> None:
    """``steps`` steps of delta chains (a full save every 4th) with a noisy val_loss, none deleted."""
    with cs.CheckpointManager(directory, keep_last=None, codec={"w": DELTA}, async_save=False) as mgr:
        for step in range(steps):
            mgr.save(step, {"w": np.full(64, float(step)), "step": step}, {"val_loss": (step * 7) % 16 / 10})


def test_gc_takes_the_keep_policies(fast_dir: Path) -> None:
    from crashsafe.cli.app import app

    _scored_run(fast_dir)
    runner = CliRunner()
    for args, needs in [
        (["--keep-best", "2"], "--keep-best needs --metric"),
        (["--metric", "val_loss"], "add --keep-best N"),
        (["--keep-best", "2", "--metric", "val_loss", "--mode", "lowest"], "mode must be 'min'"),
        (["--keep-interval", "soon"], "cannot read 'soon'"),
    ]:
        refused = runner.invoke(app, ["gc", str(fast_dir), *args])
        assert refused.exit_code != 0 and needs in refused.output, refused.output
    assert _loads_and_verifies(fast_dir) == list(range(16))  # nothing deleted by a refused gc
    args = [
        "gc",
        str(fast_dir),
        "--keep-best",
        "2",
        "--metric",
        "val_loss",
        "--mode",
        "min",
        "--keep-every",
        "8",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    # best: 0 (0.0) and 7 (0.1); 15 the newest; 8 a multiple of 8; 4, 5, 6 and 12, 13, 14 the bases of 7, 15
    assert _loads_and_verifies(fast_dir) == [0, 4, 5, 6, 7, 8, 12, 13, 14, 15]


# -------------------------------------------------------------------------- SIGKILL in metric-driven deletion


BY_METRIC = ["--keep-best", "2", "--metric", "val_loss", "--mode", "min"]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(SRC), "PYTHONUNBUFFERED": "1", **extra}


@pytest.mark.timeout(120)
def test_sigkill_during_gc_by_metric_never_loses_a_kept_step(tmp_path: Path) -> None:
    """`crashsafe gc --keep-best 2 --metric val_loss --keep-last 1` deletes most of a run of delta
    chains, on a local directory and on an object store (file://); kill it for real at a random one
    of its deletions: every step left loads, the steps to keep are all there, the next gc finishes."""
    template = tmp_path / "template"
    _scored_run(template)
    steps, facts, bases = _history(template)
    keep = KeepLast(1) | KeepBest(2, "val_loss")
    must = expected_kept(steps, facts, bases, keep, set())
    assert len(steps) - len(must) == 7  # 1, 2, 3, 8, 9, 10, 11 go
    rng = random.Random(19)
    aims = [("local", p, rng.randint(1, 7)) for p in ("after_trash_rename", "mid_delete")]
    aims += [("file", p, rng.randint(1, 7)) for p in ("after_unlink_manifest", "mid_delete")]
    for kind, point, nth in aims:
        directory = tmp_path / f"{kind}-{point}-{nth}"
        subprocess.run(["cp", "-a", str(template), str(directory)], check=True)
        location = str(directory) if kind == "local" else f"file://{directory}"
        result = subprocess.run(
            [sys.executable, "-m", "crashsafe.cli", "gc", location, "--keep-last", "1", *BY_METRIC],
            env=_env(CRASHSAFE_KILL_AT=f"{point}:{nth}"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == -signal.SIGKILL, (point, result.stdout, result.stderr)
        left = _loads_and_verifies(location)
        assert must <= set(left) and len(left) < len(steps), (point, nth, left)
        with cs.CheckpointManager(location, keep=keep) as mgr:
            mgr.gc()
        assert set(_loads_and_verifies(location)) == must


@pytest.mark.timeout(120)
def test_sigkill_during_retention_after_a_save_never_loses_a_kept_step(tmp_path: Path) -> None:
    """A training process keeps its best 2 steps by val_loss and the newest (delta chains); kill it
    for real in the middle of the n-th deletion its retention makes: every step left loads, the best
    two of all steps it committed are there, and reopening with the same policy tidies up exactly."""
    keep = KeepLast(1) | KeepBest(2, "val_loss")
    for nth in (3, 11):
        directory = Path(tempfile.mkdtemp(dir=SHM)) / "ckpt"
        try:
            result = subprocess.run(
                [sys.executable, str(HERE / "scripts" / "keep_best_train.py"), str(directory), "40"],
                env=_env(CRASHSAFE_KILL_AT=f"mid_delete:{nth}"),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert result.returncode == -signal.SIGKILL, result.stderr
            printed = [int(line) for line in result.stdout.split()]
            left = _loads_and_verifies(directory)
            steps, facts, bases = _history(directory)
            assert max(left) == len(printed)  # killed while retaining the step after the last printed
            vals = {s: facts[s].metrics["val_loss"] for s in steps}
            for step in range(len(printed) + 1):  # the best two of every step committed are still here
                val = 1.0 / (1 + step) + (step * 7919 % 13) / 40
                assert step in left or sum(v <= val for v in vals.values()) >= 2
            with cs.CheckpointManager(directory, keep=keep) as mgr:
                mgr.gc()
            assert set(_loads_and_verifies(directory)) == expected_kept(steps, facts, bases, keep, set())
        finally:
            shutil.rmtree(directory.parent)


def test_the_union_of_the_cli_matches_the_library() -> None:
    from crashsafe.cli.keep import keep_policy

    assert keep_policy(None, None, None, None, None, "min", "keep") == KeepLast(3)
    assert keep_policy(None, 5, None, None, None, "min", "keep") == KeepLast(3) | KeepEvery(5)
    union = keep_policy(None, None, "1h", 3, "val_loss", "max", "drop")
    assert union == KeepUnion(KeepEveryInterval(3600), KeepBest(3, "val_loss", "max", "drop"))
