"""Steps with references (format version 4) in a real S3 API (moto's server on 127.0.0.1): read,
verified, retained and collected there; and mirrored from a local directory, where the mirror holds
the referenced bytes once (with the step that holds them) and a step counts as mirrored only when
the step it refers to is mirrored too."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import s3fs

import crashsafe as cs
from crashsafe.copying import check_copy, copy_step
from crashsafe.errors import CrashsafeError
from crashsafe.storage.layout import step_name
from crashsafe.storage.stores import open_store

from ..refsteps import commit_references

BASE = 256 * 1024  # bytes of the frozen base: far more than what a step of references owns


def _state(step: int, frozen: int) -> dict[str, Any]:
    return {
        "base": np.full(BASE // 4, float(frozen), dtype=np.float32),
        "head": np.full(64, float(step)),
        "step": step,
    }


def _is(state: dict[str, Any], step: int, frozen: int) -> None:
    assert state["step"] == step and np.all(np.asarray(state["base"]) == float(frozen))
    assert np.all(np.asarray(state["head"]) == float(step))


def test_a_step_with_references_in_s3_reads_verifies_and_is_retained(
    bucket: str, options: dict[str, Any]
) -> None:
    url = f"s3://{bucket}/run"
    with cs.CheckpointManager(url, storage_options=options, keep_last=None, async_save=False) as mgr:
        mgr.save(10, _state(10, 10))
        mgr.save(20, _state(20, 20))
    commit_references(url, 30, 20, {"head": _state(30, 20)["head"]}, storage_options=options)
    reader = cs.CheckpointManager(url, storage_options=options, read_only=True)
    _is(reader.load(), 30, 20)
    live = _state(0, 0)
    assert reader.restore(live) == 30
    _is(live, 30, 20)
    report = cs.verify(url, storage_options=options)
    assert report.ok and report.leftovers == [] and report.steps[2].references == {20}
    assert report.steps[2].stored_bytes < 4096 < BASE <= report.steps[2].referenced_bytes
    with cs.CheckpointManager(url, storage_options=options, keep_last=1) as mgr:
        assert mgr.gc() == [10] and mgr.steps() == [20, 30]
        with pytest.raises(CrashsafeError, match="cannot delete step 20"):
            mgr.delete([20])
    store = open_store(url, storage_options=options)
    try:
        assert store.leftovers() == []  # the bytes step 30 refers to are step 20's own files
    finally:
        store.close()
    _is(reader.load(30), 30, 20)


def _mirrored(tmp_path: Path, options: dict[str, Any], mirror: str) -> Path:
    """Steps 10 and 20 saved locally and mirrored; 30 and 40 refer to step 20's base."""
    local = tmp_path / "local"
    with cs.CheckpointManager(local, keep_last=None, mirror=mirror, storage_options=options) as mgr:
        mgr.save(10, _state(10, 10))
        mgr.save(20, _state(20, 20))
        assert mgr.wait_mirror(timeout=60)
    commit_references(local, 30, 20, {"head": _state(30, 20)["head"]})
    commit_references(local, 40, 30, {"head": _state(40, 20)["head"]})
    return local


def test_the_mirror_holds_referenced_bytes_once_and_keeps_the_step_holding_them(
    tmp_path: Path, bucket: str, options: dict[str, Any]
) -> None:
    mirror = f"s3://{bucket}/run"
    local = _mirrored(tmp_path, options, mirror)
    with cs.CheckpointManager(
        local, keep_last=1, mirror=mirror, storage_options=options, mirror_keep_last=1
    ) as mgr:
        assert mgr.wait_mirror(timeout=60)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing failed to mirror
        remote = cs.CheckpointManager(mirror, storage_options=options, read_only=True)
        assert remote.steps() == [20, 40]  # the newest, and the step whose bytes it refers to
        _is(remote.load(40), 40, 20)
    assert cs.CheckpointManager(local, read_only=True).steps() == [20, 40]
    fs = s3fs.S3FileSystem(**options)
    sizes = {s: sum(fs.du(f"{bucket}/run/{step_name(s)}", total=False).values()) for s in (20, 40)}
    assert sizes[40] < 4096 < BASE < sizes[20]  # the base was uploaded once, with step 20
    there = remote.manifest(40)
    holder = {p.path: p for p in remote.manifest(20).payloads}
    assert [(p.path, p.ref) for p in there.payloads if p.ref is not None] == [("base", 20)]
    base = next(p for p in there.payloads if p.path == "base")
    assert (base.file, base.offset) == (holder["base"].file, holder["base"].offset)  # the mirror's packing
    assert cs.verify(mirror, storage_options=options).ok


def test_a_step_whose_referenced_step_is_not_mirrored_does_not_count_as_mirrored(
    tmp_path: Path, bucket: str, options: dict[str, Any]
) -> None:
    mirror = f"s3://{bucket}/run"
    local = _mirrored(tmp_path, options, mirror)
    source, target = open_store(local), open_store(mirror, storage_options=options)
    try:
        copy_step(source, target, 30)
        check_copy(target, 30)  # holds: step 20 is there
        target.delete(20)
        lacks = "refers to the bytes of step 20, which the mirror does not hold"
        with pytest.raises(CrashsafeError, match=lacks):
            copy_step(source, target, 40)
        assert 40 not in target.steps()
        with pytest.raises(cs.CorruptCheckpointError, match="refers to step 20, which is missing"):
            check_copy(target, 30)  # a mirrored step whose holder went is not intact there
    finally:
        source.close()
        target.close()
    # the manager puts it right: step 20 goes up again (local retention kept it), step 30's copy
    # no longer holds (its references name the old copy's objects) and is replaced, then 40 goes up
    with (
        cs.CheckpointManager(local, keep_last=1, mirror=mirror, storage_options=options) as mgr,
        pytest.warns(cs.MirrorWarning, match="copy of step 30 .* refers to step 20, which holds it"),
    ):
        assert mgr.wait_mirror(timeout=60)
    remote = cs.CheckpointManager(mirror, storage_options=options, read_only=True)
    assert remote.steps() == [10, 20, 30, 40] and cs.verify(mirror, storage_options=options).ok
    _is(remote.load(40), 40, 20)
