"""Keep policies on an object store (a real S3 API: moto on 127.0.0.1) and on the two-tier mirror:
the same steps kept as the oracle says, delta chains intact, the best step found in either tier."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crashsafe as cs
from crashsafe.chain import direct_bases
from crashsafe.policies import KeepBest, KeepEveryInterval, KeepLast, KeepPolicy, StepFacts

from ..policies.retention_oracle import expected_kept
from .faultproxy import FaultProxy

DELTA = {"w": cs.codecs.Incremental(full_every=3)}


def _val_loss(step: int) -> float:
    return 1.0 / (1 + step) + (step * 5 % 7) / 20  # falls, with noise


def _run(
    mgr: cs.CheckpointManager, steps: range, facts_of: cs.CheckpointManager
) -> tuple[dict[int, StepFacts], dict[int, set[int]]]:
    """Save ``steps`` with a val_loss; each step's facts and delta bases, read from ``facts_of`` at once."""
    facts: dict[int, StepFacts] = {}
    bases: dict[int, set[int]] = {}
    for step in steps:
        mgr.save(step, {"w": np.full(256, float(step)), "step": step}, {"val_loss": _val_loss(step)})
        mgr.wait()
        if facts_of is not mgr:
            assert mgr.wait_mirror(timeout=60)
        manifest = facts_of.manifest(step)
        facts[step], bases[step] = StepFacts(manifest.created, manifest.metrics), set(direct_bases(manifest))
    return facts, bases


def _all_load(mgr: cs.CheckpointManager) -> list[int]:
    steps = mgr.steps()
    for step in steps:
        assert mgr.load(step)["step"] == step
    return steps


def test_an_object_store_keeps_what_the_policies_say(bucket: str, options: dict[str, Any]) -> None:
    url = f"s3://{bucket}/run"
    keep: KeepPolicy = KeepLast(1) | KeepBest(2, "val_loss") | KeepEveryInterval(0.6)
    with cs.CheckpointManager(url, storage_options=options, keep=keep, codec=DELTA) as mgr:
        facts, bases = _run(mgr, range(12), mgr)
        assert set(_all_load(mgr)) == expected_kept(range(12), facts, bases, keep, {11})
        best = min(range(12), key=lambda s: (_val_loss(s), -s))
        assert mgr.best_step("val_loss") == best
    assert cs.verify(url, storage_options=options).ok


def test_the_mirror_keeps_its_best_and_a_new_machine_restores_the_best(
    tmp_path: Path, bucket: str, options: dict[str, Any]
) -> None:
    """Locally only the newest step stays; the mirror keeps the best 3 by val_loss and the newest,
    with their delta chains; a new machine restores the best from the mirror."""
    mirror = f"s3://{bucket}/run"
    keep = KeepLast(1) | KeepBest(3, "val_loss")
    with cs.CheckpointManager(
        tmp_path / "local", keep_last=1, codec=DELTA, mirror=mirror, storage_options=options, mirror_keep=keep
    ) as mgr:
        remote = cs.CheckpointManager(mirror, storage_options=options, read_only=True)
        facts, bases = _run(mgr, range(10), remote)
    assert cs.CheckpointManager(tmp_path / "local", read_only=True).steps() == [9]
    kept = expected_kept(range(10), facts, bases, keep, set())
    assert set(_all_load(remote)) == kept and len(kept) < 10
    shutil.rmtree(tmp_path / "local")  # the machine is gone
    best = min(range(10), key=lambda s: (_val_loss(s), -s))
    fresh = {"w": np.zeros(256), "step": -1}
    with cs.CheckpointManager(tmp_path / "new", mirror=mirror, storage_options=options) as mgr:
        assert mgr.best_step("val_loss") == best
        assert mgr.restore(fresh, step="best", metric="val_loss") == best
    assert fresh["step"] == best and np.all(fresh["w"] == best)


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    fault_proxy = FaultProxy(int(s3_endpoint.rsplit(":", 1)[1]))
    try:
        yield fault_proxy
    finally:
        fault_proxy.close()


def test_gc_keeps_what_the_mirror_lacks(
    tmp_path: Path, bucket: str, options: dict[str, Any], proxy: FaultProxy
) -> None:
    """With the mirror unreachable, an explicit gc, like the retention after a save, keeps every
    local step that is not mirrored yet (and its bases)."""
    client = {**options["client_kwargs"], "endpoint_url": proxy.endpoint}
    flaky = {**options, "client_kwargs": client, "config_kwargs": {"retries": {"max_attempts": 1}}}
    mirror = f"s3://{bucket}/run"
    keep = KeepBest(1, "val_loss", missing="drop")
    with cs.CheckpointManager(tmp_path / "local", keep=keep, mirror=mirror, storage_options=flaky) as mgr:
        local = cs.CheckpointManager(tmp_path / "local", read_only=True)
        proxy.fault("drop")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", cs.MirrorWarning)
            for step in range(1, 5):
                mgr.save(step, {"step": step}, {"val_loss": _val_loss(step)})
            assert not mgr.wait_mirror(timeout=60)
            assert mgr.gc() == [] and local.steps() == [1, 2, 3, 4]
            proxy.fault("pass", 0)
            mgr.save(5, {"step": 5}, {"val_loss": _val_loss(5)})
            assert mgr.wait_mirror(timeout=60)
            best = min(range(1, 6), key=_val_loss)
            assert local.steps() == sorted({best, 5}) and mgr.gc() == []  # all mirrored: retention as usual
