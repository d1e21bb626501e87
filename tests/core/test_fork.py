"""A forked child of a process that saved (multiprocessing's "fork" start method, DataLoader
workers, sweeps that fork) can save with a manager of its own, and cannot write with, nor unlock,
its parent's: the library's process-level thread pools are made anew in the child
(crashsafe/_runtime.py). Each child is real and is killed if it hangs, which fails the test."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest

import crashsafe as cs

EIGHT_MB = np.arange(1 << 20, dtype=np.float64)  # over the size hashed on another thread while written


def save_own(directory: Path, async_save: bool) -> None:
    with cs.CheckpointManager(directory, async_save=async_save) as mgr:
        mgr.save(1, {"w": EIGHT_MB})


def _in_child(target: object, *args: object) -> int | None:
    """Run ``target(*args)`` in a forked child; its exit code (None: it hung, and was killed)."""
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=target, args=args)
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        child.join()
        return None
    return child.exitcode


@pytest.mark.parametrize("async_save", [False, True])
def test_a_forked_child_of_a_process_that_saved_saves(tmp_path: Path, async_save: bool) -> None:
    """The child hung forever in its save: the hashing pool it inherited had no threads."""
    with cs.CheckpointManager(tmp_path / "parent", async_save=False) as mgr:
        mgr.save(1, {"w": EIGHT_MB})  # the parent's pools now have threads, which a fork does not copy
    assert _in_child(save_own, tmp_path / "child", async_save) == 0
    loaded = cs.CheckpointManager(tmp_path / "child", read_only=True).load()
    assert np.array_equal(loaded["w"], EIGHT_MB)
    with cs.CheckpointManager(tmp_path / "parent", async_save=False) as mgr:  # and the parent goes on
        mgr.save(2, {"w": EIGHT_MB})


def _use_parents(mgr: cs.CheckpointManager) -> None:
    with pytest.raises(cs.CrashsafeError, match=r"is a fork of it.*'spawn'"):
        mgr.save(5, {"w": EIGHT_MB})
    assert mgr.load(1)["w"][1] == 1.0  # reading is fine
    mgr.close()  # must not free the parent's lock


def test_a_forked_child_cannot_write_with_its_parents_manager_nor_unlock_it(tmp_path: Path) -> None:
    """A child sharing its parent's writer could commit steps under the parent's lock beside it, and
    its close() unlocked the parent's directory for a second writer."""
    with cs.CheckpointManager(tmp_path, async_save=True) as mgr:
        mgr.save(1, {"w": EIGHT_MB})
        mgr.wait()  # committed (the child must not wait for a save in flight: it is the parent's)
        mgr.save(2, {"w": EIGHT_MB})  # in flight at the fork, perhaps
        assert _in_child(_use_parents, mgr) == 0
        with pytest.raises(cs.LockedError, match=f"pid {os.getpid()}"):
            cs.CheckpointManager(tmp_path)
        mgr.save(3, {"w": EIGHT_MB})
    assert cs.CheckpointManager(tmp_path, read_only=True).steps() == [1, 2, 3]


def test_spawned_and_forkserver_children_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other start methods begin a fresh interpreter: nothing of the parent's to reset."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "scripts"))  # the child imports its target
    from fork_child import save_own as spawned_save
    with cs.CheckpointManager(tmp_path / "parent", async_save=False) as mgr:
        mgr.save(1, {"w": EIGHT_MB})
    for method in ("spawn", "forkserver"):
        context = multiprocessing.get_context(method)
        child = context.Process(target=spawned_save, args=(tmp_path / method, False))
        child.start()
        child.join(120)
        assert child.exitcode == 0, method
    assert cs.CheckpointManager(tmp_path / "spawn", read_only=True).steps() == [1]
