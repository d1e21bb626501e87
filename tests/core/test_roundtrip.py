"""Every supported value round-trips through save/load and restore, sync and async."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import crashsafe as cs

TORCH_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(
            shape, generator=g, dtype=torch.float64 if not dtype.is_complex else torch.complex128
        ).to(dtype)
    return torch.randint(0, 100, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("async_save", [True, False])
def test_every_torch_dtype_round_trips_bit_exact(tmp_path: Any, async_save: bool) -> None:
    state = {f"t_{str(d).split('.')[-1]}": _random_tensor(d, (3, 5)) for d in TORCH_DTYPES}
    state["scalar0d"] = torch.tensor(3.5)
    state["empty"] = torch.zeros(0, 4)
    state["noncontig"] = torch.arange(20.0).reshape(4, 5).t()
    with cs.CheckpointManager(tmp_path, async_save=async_save) as mgr:
        mgr.save(1, state)
        loaded = mgr.load()
    for name, tensor in state.items():
        got = loaded[name]
        assert isinstance(got, torch.Tensor), name
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(
            got.view(-1).view(torch.uint8) if got.numel() else got,
            tensor.contiguous().view(-1).view(torch.uint8) if tensor.numel() else tensor,
        ), name


def test_python_values_numpy_and_nesting_round_trip(tmp_path: Any) -> None:
    state = {
        "ints": [0, -1, 2**80, True, False],
        "floats": (0.1, -0.0, float("inf"), float("-inf")),
        "none": None,
        "text": "héllo ✓",
        "raw": b"\x00\xffbytes",
        "np": {
            "f4": np.arange(6, dtype=np.float32).reshape(2, 3),
            "big_endian": np.arange(4, dtype=">i4"),
            "strided": np.arange(30.0)[::3],
            "scalar": np.int16(-7),
            "zero_d": np.array(2.5),
        },
        "int_keys": {0: "a", 1: {2: [3]}},
    }
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(5, state)
        loaded = mgr.load(5)
    assert loaded["ints"] == [0, -1, 2**80, True, False]
    assert loaded["floats"][:2] == (0.1, -0.0) and str(loaded["floats"][1]) == "-0.0"
    assert loaded["floats"][2:] == (float("inf"), float("-inf"))
    assert loaded["none"] is None and loaded["text"] == "héllo ✓" and loaded["raw"] == b"\x00\xffbytes"
    assert loaded["int_keys"] == {0: "a", 1: {2: [3]}}
    np_ = loaded["np"]
    assert np_["f4"].dtype == np.float32 and np.array_equal(np_["f4"], state["np"]["f4"])
    assert np.array_equal(np_["big_endian"], np.arange(4)) and np_["big_endian"].dtype == np.int32
    assert np.array_equal(np_["strided"], np.arange(30.0)[::3])
    assert isinstance(np_["scalar"], np.int16) and np_["scalar"] == -7
    assert np_["zero_d"].shape == () and np_["zero_d"] == 2.5


def test_nan_payloads_are_kept_exactly(tmp_path: Any) -> None:
    weird = np.array([np.nan, -np.nan, np.inf, 0.0, -0.0], dtype=np.float32)
    weird.view(np.uint32)[0] = 0x7FC00123  # a NaN with a payload
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(0, {"w": weird})
        assert mgr.load()["w"].tobytes() == weird.tobytes()


def test_restore_in_place_into_model_optimizer_scheduler(
    tmp_path: Any, torch_state: dict[str, Any], fresh_state: Any
) -> None:
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(3, torch_state)
        target = fresh_state()
        param_ids = [id(p) for p in target["model"].parameters()]
        assert mgr.restore(target) == 3
    assert [id(p) for p in target["model"].parameters()] == param_ids  # loaded in place
    for a, b in zip(torch_state["model"].parameters(), target["model"].parameters(), strict=True):
        assert torch.equal(a, b)
    sa, sb = torch_state["optim"].state_dict(), target["optim"].state_dict()
    for k in sa["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa["state"][k][name], sb["state"][k][name])
    assert target["sched"].state_dict() == torch_state["sched"].state_dict()
    assert target["step"] == 3


def test_rng_state_restores_every_generator(tmp_path: Any) -> None:
    import random

    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(0, {"rng": cs.RNGState()})
        expected = (random.random(), np.random.rand(), torch.rand(1).item())
        random.seed(99)
        np.random.seed(99)
        torch.manual_seed(99)
        mgr.restore({"rng": cs.RNGState()})
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


@pytest.mark.parametrize(
    ("state", "where"),
    [
        ({"model": {"fn": lambda x: x}}, "model.fn"),
        ({"a": [1, {"b": object()}]}, "a.1.b"),
        ({"obj": np.array(["x"], dtype=object)}, "obj"),
        ({"s": np.array(["text"])}, "s"),
        ({"k": {(1, 2): 3}}, "k"),
        ({"sparse": torch.eye(3).to_sparse()}, "sparse"),
    ],
)
def test_unsupported_values_are_refused_with_their_path(tmp_path: Any, state: Any, where: str) -> None:
    with cs.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(cs.UnsupportedStateError, match=f"'{where}'"):
            mgr.save(1, state)
        assert mgr.steps() == []


def test_restore_refuses_mismatched_shapes_and_missing_keys(tmp_path: Any) -> None:
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.zeros(3), "n": 1})
        with pytest.raises(cs.UnsupportedStateError, match="'w'.*shape"):
            mgr.restore({"w": torch.zeros(4), "n": 0})
        with pytest.raises(cs.UnsupportedStateError, match="'extra' is not in the checkpoint"):
            mgr.restore({"w": torch.zeros(3), "extra": 0})


def test_restore_returns_none_without_checkpoints(tmp_path: Any) -> None:
    with cs.CheckpointManager(tmp_path) as mgr:
        state = {"w": torch.ones(2)}
        assert mgr.restore(state) is None
        assert torch.equal(state["w"], torch.ones(2))
        with pytest.raises(cs.NoCheckpointError):
            mgr.load()


arrays = hnp.arrays(
    dtype=st.sampled_from([np.float32, np.float64, np.int8, np.uint16, np.int64, np.bool_, np.complex64]),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=16),
    arrays,
)
trees = st.recursive(
    leaves,
    lambda kids: st.one_of(
        st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=5), kids, max_size=3)
    ),
    max_leaves=12,
)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.tobytes() == b.tobytes()
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_equal, a, b))
    return type(a) is type(b) and a == b


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=trees)
def test_property_any_supported_tree_round_trips(tmp_path_factory: Any, tree: Any) -> None:
    directory = tmp_path_factory.mktemp("prop")
    with cs.CheckpointManager(directory, async_save=True) as mgr:
        mgr.save(0, {"root": tree})
        assert _equal(mgr.load()["root"], tree)


def test_mismatched_restore_changes_nothing(tmp_path: Any) -> None:
    """A checkpoint of another architecture is refused before any live tensor is touched."""
    small = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": small, "w": torch.ones(3), "step": 1})
        other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))  # last layer differs
        live = {"model": other, "w": torch.zeros(3), "step": 0}
        before = [p.detach().clone() for p in other.parameters()]
        with pytest.raises(cs.UnsupportedStateError, match=r"model\.1\.weight.*shape"):
            mgr.restore(live)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True))
    assert torch.equal(live["w"], torch.zeros(3)) and live["step"] == 0
