"""`crashsafe diff` on real steps, through the console script: identical, one tensor perturbed, a
shape and a dtype change, python values; in this process: two checkpoints, delta chains, --prefix,
refused arguments; and the comparison's arithmetic as properties."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import crashsafe as cs
from crashsafe.diff import compare_states, diff_steps

from .conftest import assert_fits, check_json, first_column, invoke, invoke_here


def _model_state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    return {"model": model.state_dict(), "lr": 0.1, "name": "run", "step": 7}


def _save(directory: Path, *states: dict[str, Any], **manager: Any) -> None:
    with cs.CheckpointManager(directory, keep_last=None, **manager) as mgr:
        for step, state in enumerate(states, start=1):
            mgr.save(step, state)


def _paths(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["path"]: p for p in doc["paths"]}


def test_identical_steps_exit_0(tmp_path: Path) -> None:
    _save(tmp_path, _model_state(), _model_state())
    same = invoke("diff", str(tmp_path), "1", "2")
    assert same.code == 0 and "identical" in same.out and "differ" not in same.out
    doc = check_json(invoke("diff", str(tmp_path), "1", "2", "--json").out, "diff")
    assert doc["identical"] and doc["counts"]["identical"] == 7 == len(doc["paths"])
    assert all(p["changed"] == 0 for p in doc["paths"])


def test_one_tensor_perturbed(tmp_path: Path) -> None:
    a, b = _model_state(), _model_state()
    b["model"]["2.weight"] = b["model"]["2.weight"].clone()
    b["model"]["2.weight"][1, 3] += 0.25
    _save(tmp_path, a, b)
    ran = invoke("diff", str(tmp_path), "1", "2")
    assert ran.code == 1 and "they differ" in ran.out
    rows = first_column(ran.out, "path")
    assert [(path, rest[:5]) for path, rest in rows] == [
        ("model.2.weight", ["differs", "1", "of", "32", "elements"])
    ]
    doc = check_json(invoke("diff", str(tmp_path), "1", "2", "--json").out, "diff")
    changed = _paths(doc)["model.2.weight"]
    expected = abs(float(b["model"]["2.weight"][1, 3]) - float(a["model"]["2.weight"][1, 3]))
    assert changed["changed"] == 1 and changed["max_abs"] == pytest.approx(expected)
    assert changed["mean_abs"] == pytest.approx(expected / 32)
    assert doc["counts"] == {**dict.fromkeys(doc["counts"], 0), "identical": 6, "differs": 1}


def test_shape_dtype_values_and_paths_in_one_side(tmp_path: Path) -> None:
    a, b = _model_state(), _model_state()
    b["model"]["0.weight"] = torch.zeros(8, 17)  # a wider input layer
    b["model"]["0.bias"] = a["model"]["0.bias"].to(torch.bfloat16)
    b["lr"], b["name"] = float("nan"), 3
    del b["model"]["2.bias"]
    b["extra"] = np.arange(3)
    _save(tmp_path, a, b)
    doc = check_json(invoke("diff", str(tmp_path), "1", "2", "--json").out, "diff")
    paths = _paths(doc)
    assert paths["model.0.weight"]["status"] == "shape_changed"
    assert (paths["model.0.weight"]["shape_a"], paths["model.0.weight"]["shape_b"]) == ([8, 16], [8, 17])
    assert paths["model.0.bias"]["status"] == "dtype_changed"
    assert (paths["model.0.bias"]["dtype_a"], paths["model.0.bias"]["dtype_b"]) == ("float32", "bfloat16")
    assert paths["lr"]["status"] == "differs" and paths["lr"]["nonfinite"] == 1
    assert (paths["lr"]["value_a"], paths["lr"]["value_b"]) == (0.1, "nan")  # strict JSON
    assert paths["name"]["status"] == "dtype_changed" and paths["name"]["dtype_b"] == "int"
    assert paths["model.2.bias"]["status"] == "only_a" and paths["extra"]["status"] == "only_b"
    assert [p["path"] for p in doc["paths"]][-1] == "extra"  # B's own paths come last
    table = invoke("diff", str(tmp_path), "1", "2")
    assert_fits(table.out)
    for words in ("int64 3", "float32 8x16 -> float32 8x17", "float32 8 -> bfloat16 8", "0.1 -> nan"):
        assert words in table.out


def test_two_checkpoints_and_their_delta_chains(tmp_path: Path) -> None:
    """The newest steps of two checkpoints by default; --step-a/--step-b; a delta-coded step is
    compared as a load reads it (through its chain)."""
    states = [{"w": torch.arange(64.0) * (1 + s / 100), "step": s} for s in range(6)]
    _save(tmp_path / "chained", *states, codec={"w": cs.codecs.Incremental(full_every=3)})
    _save(tmp_path / "plain", *states)
    newest = check_json(
        invoke_here("diff", str(tmp_path / "chained"), str(tmp_path / "plain"), "--json").out, "diff"
    )
    assert newest["identical"] and newest["a"]["step"] == newest["b"]["step"] == 6
    older = diff_steps(tmp_path / "chained", 5, tmp_path / "plain", 2)
    w = older.paths[0]
    expected = (states[4]["w"] - states[1]["w"]).abs()
    assert w.path == "w" and w.max_abs == pytest.approx(float(expected.max()))
    assert w.mean_abs == pytest.approx(float(expected.mean()))
    flags = invoke_here(
        "diff", str(tmp_path / "chained"), str(tmp_path / "plain"), "--step-a", "5", "--step-b", "2"
    )
    assert flags.code == 1 and "A = step 5 of" in " ".join(flags.out.split())


def test_prefix_and_all(tmp_path: Path) -> None:
    a, b = _model_state(0), _model_state(1)
    _save(tmp_path, a, b)
    model = check_json(
        invoke_here("diff", str(tmp_path), "1", "2", "--prefix", "model.", "--json").out, "diff"
    )
    assert {p["path"] for p in model["paths"]} == {f"model.{k}" for k in a["model"]}
    values = invoke_here("diff", str(tmp_path), "1", "2", "--prefix", "lr", "--prefix", "step", "--all")
    assert values.code == 0 and [path for path, _ in first_column(values.out, "path")] == ["lr", "step"]


def test_bad_arguments_say_what_to_type(tmp_path: Path) -> None:
    _save(tmp_path, _model_state())
    two = invoke_here("diff", str(tmp_path), "1")
    assert two.code == 2 and "crashsafe diff DIR A B" in two.err
    word = invoke_here("diff", str(tmp_path), "one", "2")
    assert word.code == 2 and "'one' is not a step number" in word.err
    mixed = invoke_here("diff", str(tmp_path), "1", "1", "--step-a", "1")
    assert mixed.code == 2 and "--step-a" in mixed.err
    gone = invoke_here("diff", str(tmp_path), "1", "5")
    assert gone.code == 2 and "5" in gone.err


def test_bfloat16_and_nan_elements(tmp_path: Path) -> None:
    a = {"h": torch.tensor([1.0, 2.0, float("nan"), 4.0], dtype=torch.bfloat16), "f": np.array([np.nan, 1.0])}
    b = {
        "h": torch.tensor([1.0, 2.5, float("nan"), float("inf")], dtype=torch.bfloat16),
        "f": np.array([np.nan, 1.0]),
    }
    _save(tmp_path, a, b)
    paths = {p.path: p for p in diff_steps(tmp_path, 1, None, 2).paths}
    h = paths["h"]
    assert (h.status, h.changed, h.nonfinite, h.max_abs) == ("differs", 2, 1, 0.5)  # NaN equals NaN
    assert h.mean_abs == pytest.approx(0.5 / 2)  # over the two elements finite on both sides
    assert paths["f"].status == "identical"


finite = hnp.arrays(
    st.sampled_from([np.float32, np.float64, np.int32]),
    hnp.array_shapes(max_dims=3, max_side=6),
    elements={"min_value": -1e6, "max_value": 1e6, "allow_nan": False},
)


@settings(max_examples=60, deadline=None)
@given(finite, st.data())
def test_compare_counts_and_measures_exactly(array: np.ndarray, data: st.DataObject) -> None:
    dtype = str(array.dtype)
    same = compare_states({"x": ("tensor", dtype, array)}, {"x": ("tensor", dtype, array.copy())})
    assert same[0].status == "identical" and same[0].changed == 0
    other = array.copy()
    flat = other.reshape(-1)
    where = data.draw(st.sets(st.integers(0, max(flat.size - 1, 0)), max_size=flat.size))
    for i in where:
        flat[i] = flat[i] + (3 if array.dtype.kind == "i" else 0.5 * (1 + abs(flat[i])))
    gaps = np.abs(other.astype(np.float64) - array.astype(np.float64))
    got = compare_states({"x": ("tensor", dtype, array)}, {"x": ("tensor", dtype, other)})[0]
    moved = int(np.count_nonzero(gaps))
    assert got.changed == moved and got.status == ("identical" if moved == 0 else "differs")
    assert got.max_abs == (float(gaps.max()) if gaps.size else None)
    if gaps.size:
        assert got.mean_abs is not None and math.isclose(got.mean_abs, float(gaps.mean()), rel_tol=1e-9)
