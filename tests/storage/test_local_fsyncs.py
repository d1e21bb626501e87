"""The local commit fsyncs the data, the manifest and the temporary directory at once: each of the
three must have returned before the rename, and a failure of any one commits nothing."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import crashsafe as cs
import crashsafe.storage.local as local


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
