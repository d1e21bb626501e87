"""The ordering rules of CUDA staging, checked on the CPU with a model of the device whose copies land
only when waited for (tests/fake_device.py): every reader of a staging buffer waits for its copy,
whatever path the snapshot took (first save with device clones, later saves, the Lightning plugin,
keys that are str or int subclasses), and the pinned cap counts what torch's allocator takes.
The real thing runs on a GPU in tests/gpu/."""

from __future__ import annotations

import enum
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import crashsafe as cs
from crashsafe.errors import CrashsafeWarning
from crashsafe.state.snapshot import fast_copy
from crashsafe.state.staging import StagingPool
from crashsafe.state.tree import flatten

from ..fake_device import fake_device

__all__ = ["fake_device"]


class Key(str, enum.Enum):  # noqa: UP042 (a StrEnum's str() is its value: this one's is not)
    WEIGHT = "weight"


class Slot(int, enum.Enum):  # an int enum that is not an IntEnum: str() differs from int()
    FIRST = 3


def _state(on_device: Any) -> dict[str, Any]:
    return {
        "w": on_device(torch.zeros(1000)),
        "half": on_device(torch.zeros(300, dtype=torch.bfloat16)),
        "named": {Key.WEIGHT: on_device(torch.zeros(64)), Slot.FIRST: on_device(torch.zeros(8))},
        "cpu": torch.zeros(10),
        "step": 0,
    }


def _fill(state: dict[str, Any], value: float) -> None:
    for tensor in (state["w"], state["half"], *state["named"].values(), state["cpu"]):
        tensor.fill_(value)
    state["step"] = int(value)


@pytest.mark.parametrize("async_save", [True, False])
def test_every_save_holds_the_values_it_was_called_with(
    fake_device: Any, tmp_path: Path, async_save: bool
) -> None:
    state = _state(fake_device)
    with cs.CheckpointManager(tmp_path, keep_last=None, async_save=async_save) as mgr:
        for step in range(1, 5):  # the first save clones, the later ones copy into pinned buffers
            _fill(state, float(step))
            mgr.save(step, state)
            _fill(state, -1.0)  # training goes on at once
        mgr.wait()
        for step in range(1, 5):
            loaded = mgr.load(step)
            for name, tensor in [("w", loaded["w"]), ("half", loaded["half"]), ("cpu", loaded["cpu"]),
                                 *[(str(k), v) for k, v in loaded["named"].items()]]:  # fmt: skip
                assert bool((tensor == step).all()), f"step {step}: {name} holds {tensor.flatten()[0]}"


def test_fast_copy_stages_under_the_paths_flatten_gives(fake_device: Any) -> None:
    state = _state(fake_device)
    pool = StagingPool()
    copied = fast_copy(state, pool)
    assert copied is not None
    pool.settle()
    paths = {leaf.path for leaf in flatten(state)[1]}
    assert set(pool._slots) == paths and {"named.weight", "named.3"} <= paths


def test_the_lightning_plugin_saves_what_it_was_given(fake_device: Any, tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from crashsafe.integrations.lightning import CrashsafeCheckpointIO

    io = CrashsafeCheckpointIO(in_flight=1)
    weight = fake_device(torch.zeros(1000))
    try:
        for step in range(4):  # the first save is checked in full, the others take the fast walk
            weight.fill_(float(step))
            io.save_checkpoint({"state_dict": {"w": weight}, "global_step": step}, tmp_path / f"s{step}.ckpt")
            weight.fill_(-1.0)
        io.wait()
        for step in range(4):
            assert bool((io.load_checkpoint(tmp_path / f"s{step}.ckpt")["state_dict"]["w"] == step).all())
    finally:
        io.teardown()


def test_the_pinned_cap_counts_what_the_allocator_takes_and_says_so_once(
    fake_device: Any, tmp_path: Path
) -> None:
    state = {f"t{i}": fake_device(torch.full((1000,), float(i))) for i in range(3)}  # 4000 bytes each
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cs.CheckpointManager(tmp_path, pinned_bytes=10_000) as mgr:
            for step in range(3):
                mgr.save(step, state)
            mgr.wait()
            assert mgr._pool is not None and mgr._pool.pinned_nbytes == 2 * 4096  # a power of two each
            loaded = mgr.load(2)
    said = [
        w for w in caught if issubclass(w.category, CrashsafeWarning) and "pinned_bytes" in str(w.message)
    ]
    assert len(said) == 1
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor)
