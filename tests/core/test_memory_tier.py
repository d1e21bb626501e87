"""The memory tier of one process (docs/memory.md): every save in the memory directory, every Nth
also persistent; restore from memory first, bit-identical; damage, a wiped memory directory and a
SIGKILL at each point of a memory save's commit fall back to an intact step."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tests.hostile import make_victim, untouched

import crashsafe as cs
from crashsafe._faults import COMMIT_POINTS, RECYCLE_POINTS
from crashsafe.errors import (
    CorruptCheckpointError,
    CorruptCheckpointWarning,
    InvalidArgumentError,
    NoCheckpointError,
    StorageError,
)
from crashsafe.state.rng import RNGState
from crashsafe.storage.layout import committed_steps, step_dir


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(16, 32)).square().mean()
    optim.zero_grad()
    loss.backward()
    optim.step()


def _job() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    return {"model": model, "optim": torch.optim.AdamW(model.parameters()), "rng": RNGState(), "step": 0}


def _params(state: dict[str, Any]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state["model"].parameters()]


def _run(disk: Path, tier: cs.MemoryTier, steps: range, state: dict[str, Any]) -> list[list[torch.Tensor]]:
    seen = []
    with cs.CheckpointManager(disk, memory=tier) as mgr:
        for step in steps:
            _train(state["model"], state["optim"])
            state["step"] = step
            mgr.save(step, state)
            seen.append(_params(state))
    return seen


def test_every_save_goes_to_memory_and_every_nth_to_disk(tmp_path: Path) -> None:
    tier = cs.MemoryTier(tmp_path / "mem", persist_every=3, keep_last=2)
    state = _job()
    _run(tmp_path / "disk", tier, range(1, 8), state)
    assert committed_steps(tmp_path / "mem" / "rank_0") == [6, 7]
    assert committed_steps(tmp_path / "disk") == [3, 6]


def test_restore_comes_from_memory_bit_identical_and_says_so(tmp_path: Path) -> None:
    tier = cs.MemoryTier(tmp_path / "mem", persist_every=4)
    state = _job()
    seen = _run(tmp_path / "disk", tier, range(1, 7), state)
    expected_rng = torch.get_rng_state()
    fresh = _job()
    torch.manual_seed(99)
    with cs.CheckpointManager(tmp_path / "disk", memory=tier) as mgr:
        assert mgr.restore(fresh) == 6
        assert mgr.recovery is not None and (mgr.recovery.step, mgr.recovery.source) == (6, "memory")
    assert fresh["step"] == 6
    assert all(torch.equal(a, b) for a, b in zip(_params(fresh), seen[-1], strict=True))
    assert torch.equal(torch.get_rng_state(), expected_rng)
    # the optimizer's moments too: one more step from either gives the same parameters
    _train(state["model"], state["optim"])
    torch.set_rng_state(expected_rng)
    _train(fresh["model"], fresh["optim"])
    assert all(torch.equal(a, b) for a, b in zip(_params(fresh), _params(state), strict=True))


def test_a_wiped_memory_directory_restores_from_disk(tmp_path: Path) -> None:
    tier = cs.MemoryTier(tmp_path / "mem", persist_every=4)
    seen = _run(tmp_path / "disk", tier, range(1, 7), _job())
    for path in sorted((tmp_path / "mem").rglob("*"), reverse=True):  # the host lost its memory
        path.rmdir() if path.is_dir() else path.unlink()
    fresh = _job()
    with cs.CheckpointManager(tmp_path / "disk", memory=tier) as mgr:
        assert mgr.restore(fresh) == 4
        assert mgr.recovery is not None and mgr.recovery.source == "persistent"
    assert all(torch.equal(a, b) for a, b in zip(_params(fresh), seen[3], strict=True))


def test_a_damaged_memory_step_falls_back_to_the_one_before(tmp_path: Path) -> None:
    tier = cs.MemoryTier(tmp_path / "mem", persist_every=10, keep_last=3)
    seen = _run(tmp_path / "disk", tier, range(1, 6), _job())
    newest = tmp_path / "mem" / "rank_0" / "step_000000000005"
    data = next(p for p in newest.iterdir() if p.name != "manifest.json")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one flipped bit
    data.write_bytes(bytes(raw))
    fresh = _job()
    with cs.CheckpointManager(tmp_path / "disk", memory=tier) as mgr, pytest.warns(CorruptCheckpointWarning):
        assert mgr.restore(fresh) == 4
    assert all(torch.equal(a, b) for a, b in zip(_params(fresh), seen[3], strict=True))
    assert committed_steps(tmp_path / "mem" / "rank_0") == [3, 4]  # the damaged copy went, no other


def test_restoring_an_older_step_drops_the_newer_memory_steps(tmp_path: Path) -> None:
    tier = cs.MemoryTier(tmp_path / "mem", persist_every=10, keep_last=4)
    seen = _run(tmp_path / "disk", tier, range(1, 6), _job())
    fresh = _job()
    with cs.CheckpointManager(tmp_path / "disk", memory=tier) as mgr:
        assert mgr.restore(fresh, step=3) == 3
        assert committed_steps(tmp_path / "mem" / "rank_0") == [2, 3]
        mgr.save(4, {"x": np.zeros(3), "step": 4})  # a step number saved before: saved anew
    assert all(torch.equal(a, b) for a, b in zip(_params(fresh), seen[2], strict=True))
    assert committed_steps(tmp_path / "mem" / "rank_0") == [2, 3, 4]


def test_a_memory_step_mapped_by_a_reader_keeps_its_bytes_once_retention_deletes_it(tmp_path: Path) -> None:
    """``load(mmap=True)`` of a memory store's step gives views of its data file: retention deletes
    the step, and the save after never writes over a file those views still map (it takes a new
    one); once they are gone, saves write over the step deleted last again (docs/memory.md)."""
    tier = cs.MemoryTier(tmp_path / "mem", persist_every=100, keep_last=1)
    part = tmp_path / "mem" / "rank_0"
    with cs.CheckpointManager(tmp_path / "disk", memory=tier) as mgr:
        mgr.save(1, {"x": np.full(1 << 16, 1.0)})
        mgr.wait()
        with cs.CheckpointManager(part, read_only=True) as reader:
            viewed = reader.load(1, mmap=True)["x"]
        for step in (2, 3):  # 2's retention deletes step 1 (kept as the spare), 3 is saved after it
            mgr.save(step, {"x": np.full(1 << 16, float(step))})
            mgr.wait()
        assert np.array_equal(viewed, np.full(1 << 16, 1.0))
        del viewed
        inode = (step_dir(part, 3) / "data.bin").stat().st_ino
        for step in (4, 5):  # 4's retention deletes step 3, and 5 is written over its file
            mgr.save(step, {"x": np.full(1 << 16, float(step))})
            mgr.wait()
        assert (step_dir(part, 5) / "data.bin").stat().st_ino == inode
        state = {"x": np.zeros(1 << 16)}
        assert mgr.restore(state) == 5 and np.array_equal(state["x"], np.full(1 << 16, 5.0))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", COMMIT_POINTS + RECYCLE_POINTS)
def test_a_sigkill_at_each_point_of_a_memory_save_leaves_an_intact_step(
    tmp_path: Path, point: str, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    """Armed after three saves: the fourth save's, written over the first step's larger data file
    (the spare retention kept), or its retention's (mid_delete: the first step's rest, once taken).
    Killed once step 4 is renamed into place, step 4 is restored whole (cut to its own size)."""
    name = point.partition(":")[0]
    proc = spawn("memory_point.py", tmp_path / "disk", tmp_path / "mem", point)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -9, (name, out, err)
    with cs.CheckpointManager(tmp_path / "disk", memory=cs.MemoryTier(tmp_path / "mem")) as mgr:
        state = {"x": np.zeros(1000), "step": 0}
        step = mgr.restore(state)
    assert step in (3, 4) and state["step"] == step
    assert step == 4 or name not in ("after_rename", "after_fsync_root", "after_trash_rename")
    assert np.array_equal(state["x"], np.full(1000, float(step)))
    assert not any(p.name.startswith(".") and p.is_dir() for p in (tmp_path / "mem" / "rank_0").iterdir())


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("point", "left"),
    [("after_trash_rename:1", 3), ("after_trash_rename:2", 2), ("mid_delete:1", 2)],
)
def test_a_sigkill_while_a_restore_drops_newer_memory_steps_leaves_a_restorable_step(
    tmp_path: Path, point: str, left: int, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    """A restore of step 2 deletes memory steps 4 (kept out of view as the spare the next save is
    written over), then 3 (removed); killed in either deletion, the restart restores the newest step
    left whole, bit for bit, and clears what the deletions left."""
    proc = spawn("memory_restore_point.py", tmp_path / "disk", tmp_path / "mem", point)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -9, (point, out, err)
    assert committed_steps(tmp_path / "mem" / "rank_0") == list(range(1, left + 1))
    with cs.CheckpointManager(tmp_path / "disk", memory=cs.MemoryTier(tmp_path / "mem")) as mgr:
        state = {"x": np.zeros(1000), "step": 0}
        assert mgr.restore(state) == left
        assert mgr.recovery is not None and mgr.recovery.source == "memory"
    assert state["step"] == left and np.array_equal(state["x"], np.full(1000, float(left)))
    assert not any(p.name.startswith(".") and p.is_dir() for p in (tmp_path / "mem" / "rank_0").iterdir())


def test_a_memory_directory_that_is_a_symlink_is_refused_and_left_alone(tmp_path: Path) -> None:
    victim = make_victim(tmp_path / "victim")
    (tmp_path / "mem").mkdir()
    os.symlink(victim, tmp_path / "mem" / "rank_0")
    with pytest.raises(StorageError, match="rank_0"):
        cs.CheckpointManager(tmp_path / "disk", memory=tmp_path / "mem")
    untouched(victim)


@pytest.mark.parametrize("bad", [{"persist_every": 0}, {"copies": -1}, {"keep_last": True}])
def test_memory_tier_settings_are_checked(tmp_path: Path, bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError, match="whole number"):
        cs.MemoryTier(tmp_path, **bad)


def test_a_memory_step_damaged_once_it_wrote_into_the_live_state_is_no_fresh_start(tmp_path: Path) -> None:
    """A memory step is read straight into the live state: if it turns out damaged and no other step
    is left, restore must not return None ("nothing saved: start afresh") over a half-written state."""
    tier = cs.MemoryTier(tmp_path / "mem", persist_every=100, keep_last=1)
    with cs.CheckpointManager(tmp_path / "disk", memory=tier) as mgr:
        mgr.save(1, {"a": np.zeros(1000), "b": np.zeros(1000)})
    data = tmp_path / "mem" / "rank_0" / "step_000000000001" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[12000] ^= 0x01  # in b, the payload read last: a is in the live state by then
    data.write_bytes(bytes(raw))
    live = {"a": np.ones(1000), "b": np.ones(1000)}
    mgr = cs.CheckpointManager(tmp_path / "disk", memory=tier)
    with mgr, pytest.warns(CorruptCheckpointWarning), pytest.raises(NoCheckpointError, match="partly over"):
        mgr.restore(live)


def test_a_memory_tier_all_damaged_and_no_persistent_step_is_no_fresh_start(tmp_path: Path) -> None:
    """Every memory step damaged (found before anything live changed: the RNG state's payload) and
    no persistent step: an error, as for a persistent tier all damaged, not "no step: start afresh"."""
    tier = cs.MemoryTier(tmp_path / "mem", persist_every=100, keep_last=2)
    with cs.CheckpointManager(tmp_path / "disk", memory=tier) as mgr:
        for step in (1, 2):
            mgr.save(step, {"rng": RNGState(), "x": np.full(10, float(step))})
    for step in (1, 2):
        data = tmp_path / "mem" / "rank_0" / f"step_{step:012d}" / "data.bin"
        raw = bytearray(data.read_bytes())
        raw[3000] ^= 0x01  # in the NumPy generator's state
        data.write_bytes(bytes(raw))
    live = {"rng": RNGState(), "x": np.ones(10)}
    mgr = cs.CheckpointManager(tmp_path / "disk", memory=tier)
    with mgr, pytest.warns(CorruptCheckpointWarning), pytest.raises(CorruptCheckpointError, match="memory"):
        mgr.restore(live)
    assert np.array_equal(live["x"], np.ones(10))


def test_a_read_only_manager_refuses_a_memory_tier_it_would_not_read(tmp_path: Path) -> None:
    """read_only=True reads the persistent tier only: with memory= it would restore an older step
    than the memory tier holds, silently. Refused, saying what to do instead."""
    tier = cs.MemoryTier(tmp_path / "mem", persist_every=2)
    _run(tmp_path / "disk", tier, range(1, 4), _job())
    with pytest.raises(InvalidArgumentError, match="read_only"):
        cs.CheckpointManager(tmp_path / "disk", memory=tier, read_only=True)
    assert committed_steps(tmp_path / "mem" / "rank_0") == [2, 3]


def test_saves_count_toward_the_persistent_tier_across_restarts(tmp_path: Path) -> None:
    """Every Nth save of the run persists, not of each manager: a job restarting more often than
    every N saves would else never reach the persistent tier (and lose it all with its hosts)."""
    tier = cs.MemoryTier(tmp_path / "mem", persist_every=3)
    for start in (1, 3, 5, 7):  # restarted every 2 saves
        with cs.CheckpointManager(tmp_path / "disk", memory=tier) as mgr:
            state = {"x": np.zeros(10), "step": 0}
            assert mgr.restore(state) == (None if start == 1 else start - 1)
            for step in (start, start + 1):
                mgr.save(step, {"x": np.full(10, float(step)), "step": step})
    assert committed_steps(tmp_path / "disk") == [3, 6]
