"""The local commit fsyncs the data, the manifest and the temporary directory at once: each of the
three must have returned before the rename, and a failure of any one commits nothing. A ``file://``
location's writes are durable when they return."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import crashsafe as cs
import crashsafe.storage.local as local
from crashsafe.storage.layout import step_dir


def test_every_fsync_returns_before_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow fsync in another thread still finishes before the step appears."""
    events: list[str] = []
    lock = threading.Lock()
    real_fsync, real_rename = os.fsync, os.rename

    def slow_fsync(fd: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.05)
        real_fsync(fd)
        with lock:
            events.append("fsync")

    def rename(*args: object, **kwargs: object) -> None:
        with lock:
            events.append("rename")
        real_rename(*args, **kwargs)  # type: ignore[arg-type]

    with cs.CheckpointManager(tmp_path / "ckpt", async_save=False) as mgr:
        monkeypatch.setattr(local.os, "fsync", slow_fsync)
        monkeypatch.setattr(local.os, "rename", rename)
        mgr.save(1, {"x": np.arange(1000.0)})
        monkeypatch.undo()
        assert events[: events.index("rename")].count("fsync") >= 3  # data, manifest, directory
        assert np.array_equal(mgr.load(1)["x"], np.arange(1000.0))


def test_a_failed_fsync_in_any_thread_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_fsync = os.fsync

    def failing(fd: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    directory = tmp_path / "ckpt"
    with cs.CheckpointManager(directory, async_save=False) as mgr:
        mgr.save(1, {"x": np.ones(10)})
        monkeypatch.setattr(local.os, "fsync", failing)
        with pytest.raises(cs.StorageError, match="committing step 2"):
            mgr.save(2, {"x": np.ones(10) * 2})
        monkeypatch.undo()
    assert cs.CheckpointManager(directory, read_only=True).steps() == [1]
    assert not [p for p in directory.iterdir() if p.name.startswith(".tmp-")]


def test_a_file_url_write_is_durable_when_it_returns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``file://`` location commits as an object store does, by writing the manifest last, which
    holds only if each write is durable once acknowledged: every shard and the step directory's
    entry are fsynced before the manifest is written, and the manifest and its entry before the
    save returns."""
    synced: list[str] = []
    real_fsync = os.fsync

    def recording(fd: int) -> None:
        real_fsync(fd)
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))

    run = tmp_path / "run"
    with cs.CheckpointManager(f"file://{run}", async_save=False) as mgr:
        monkeypatch.setattr(os, "fsync", recording)
        mgr.save(1, {"x": np.arange(1000.0), "y": np.ones((3 << 20) // 8)})
        monkeypatch.undo()
    step = step_dir(run, 1)
    shards = sorted(str(p) for p in step.glob("data-*.bin"))
    manifest = synced.index(str(step / "manifest.json"))
    assert sorted(p for p in synced[:manifest] if p.startswith(f"{step}/")) == shards
    assert str(run) in synced[: synced.index(shards[0])]  # the step directory's entry, in the root
    assert synced[manifest + 1 :] == [str(step)]  # the manifest's entry
