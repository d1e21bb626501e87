"""fast_copy: the cheap point-in-time copy of later saves gives what detached_copy gives, is not
changed by training afterwards, and leaves every unusual state to detached_copy."""

from __future__ import annotations

import argparse
import dataclasses
import enum
from pathlib import Path
from typing import Any

import numpy as np
import torch

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


def test_fast_copy_gives_what_detached_copy_gives_and_stays_put() -> None:
    state = _state()
    fast = fast_copy(state, StagingPool())
    assert fast is not None
    assert _tree(fast) == _tree(detached_copy(state, StagingPool()))  # tied weights stay one view
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
    assert second["model"]["weight"].data_ptr() == first["model"]["weight"].data_ptr()
    assert _tree(second) == _tree(detached_copy(state, StagingPool()))


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
