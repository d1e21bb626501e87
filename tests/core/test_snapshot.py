"""fast_copy: the cheap point-in-time copy of later saves flattens to exactly what the live state
flattens to (tree and bytes), is not changed by training afterwards, and leaves every unusual state
to detached_copy."""

from __future__ import annotations

import argparse
import dataclasses
import enum
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from crashsafe import CheckpointManager, UnsupportedStateError
from crashsafe.state.snapshot import fast_copy
from crashsafe.state.staging import StagingPool, detached_copy, view_bytes
from crashsafe.state.tree import flatten


class Color(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Config:
    sizes: list[int]
    name: str = "net"


def _state() -> dict[str, Any]:
    model = torch.nn.Linear(4, 3)
    tied = model.weight.detach()
    return {
        "model": model,  # a state_dict() taken now
        "tied": {"a": tied, "b": tied, "ids": torch.arange(5)},  # one tensor saved twice
        "optim": {"state": {0: {"step": torch.tensor(3.0), "m": np.ones((2, 2), np.float32)}}},
        "hparams": argparse.Namespace(lr=0.1, dtype=torch.float16, path=Path("/d"), color=Color.RED),
        "config": Config([1, 2]),
        "loops": [{"epoch": 2, "done": True, "nothing": None, "raw": bytearray(b"xy")}, (1, 2.5, "s")],
        "scalar": np.float64(1.5),
    }


def _tree(value: Any) -> dict[str, Any]:
    tree, leaves = flatten(value)
    return {"tree": tree, "data": [view_bytes(leaf).tobytes() for leaf in leaves]}


def test_fast_copy_saves_as_the_live_state_and_stays_put() -> None:
    state = _state()
    fast = fast_copy(state, StagingPool())
    assert fast is not None
    assert _tree(fast) == _tree(state)  # the module as a module, tied weights as one view
    assert _tree(detached_copy(state, StagingPool()))["data"] == _tree(state)["data"]
    assert fast["tied"]["a"] is fast["tied"]["b"]
    before = _tree(fast)
    with torch.no_grad():
        state["model"].weight.add_(1.0)
    state["optim"]["state"][0]["m"] += 1
    state["loops"][0]["epoch"] = 3
    state["loops"][0]["raw"][0] = 0
    state["config"].sizes.append(3)
    state["hparams"].lr = 0.2
    assert _tree(fast) == before


def test_a_second_copy_reuses_the_buffers() -> None:
    pool, state = StagingPool(), _state()
    first = fast_copy(state, pool)
    with torch.no_grad():
        state["model"].weight.mul_(2.0)
    second = fast_copy(state, pool)
    assert first is not None and second is not None
    assert second["model"].state["weight"].data_ptr() == first["model"].state["weight"].data_ptr()
    assert _tree(second) == _tree(state)


def test_what_fast_copy_cannot_judge_goes_to_detached_copy() -> None:
    base = torch.zeros(6)
    for unusual in (
        {"w": base, "half": base[:3]},  # a view of another saved tensor
        {"a.b": torch.zeros(1), "a": {"b": torch.ones(1)}},  # two arrays, one dotted path
        {"f": object()},
        {(1, 2): 3},
        {"big": 2**70},
        {"obj": np.array(["x"], dtype=object)},
    ):
        assert fast_copy(unusual, StagingPool()) is None, unusual


def test_a_later_async_save_stores_what_the_first_stored(tmp_path: Path) -> None:
    """The first async save checks the state in full; later ones copy it with fast_copy and flatten
    the copy in the background: the same tree (the module still a module) and the same bytes. A
    state fast_copy cannot judge is still checked at the save call, naming the bad value's path."""
    state = _state()
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        with pytest.raises(UnsupportedStateError, match="state at 'bad'"):
            mgr.save(3, {**state, "bad": object()})
        mgr.wait()
        first, second = mgr.manifest(1), mgr.manifest(2)
        assert first.tree == second.tree and second.tree["vals"][0]["t"] == "stateful"
        assert [p.xxh3 for p in first.payloads] == [p.xxh3 for p in second.payloads]
        assert mgr.steps() == [1, 2]
