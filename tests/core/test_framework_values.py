"""The tree nodes for values frameworks put in checkpoints (dtypes, devices, paths, namespaces, enum
members, dataclasses, views of tied tensors): forged ones are refused before use, names come from
fixed lists torch really parses, and a class name is never imported."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import pytest
import torch

from crashsafe.errors import CorruptCheckpointError
from crashsafe.format.tree import DEVICE_TYPES, MAX_DEVICE_INDEX, TORCH_DTYPE_NAMES, validate_tree
from crashsafe.state.rebuild import live_class, unflatten

VIEW = {"t": "view", "id": 0, "offset": 0, "shape": [2, 3], "stride": [3, 1]}
TORCH_6 = [("torch", (6,))]


def _tree(*nodes: dict[str, Any]) -> dict[str, Any]:
    return {"t": "list", "items": [{"t": "array", "id": 0}, *nodes]}


FORGED: dict[str, tuple[dict[str, Any], list[tuple[str, tuple[int, ...]]], str]] = {
    "view past the end": ({**VIEW, "offset": 1}, TORCH_6, "reaching outside it"),
    "view with a wide stride": ({**VIEW, "stride": [4, 1]}, TORCH_6, "reaching outside it"),
    "view of more elements": ({**VIEW, "shape": [7], "stride": [0]}, TORCH_6, "reaching outside it"),
    "view of a numpy payload": (VIEW, [("numpy", (6,))], "not a torch payload"),
    "view of no payload": ({**VIEW, "id": 3}, TORCH_6, "not a torch payload"),
    "negative stride": ({**VIEW, "stride": [-3, 1]}, TORCH_6, "invalid view stride"),
    "strides and shape differ": ({**VIEW, "stride": [1]}, TORCH_6, "has a view with shape"),
    "object dtype": ({"t": "dtype", "v": "object"}, TORCH_6, "malformed 'dtype' value"),
    "device index torch would wrap": ({"t": "device", "v": "cuda:128"}, TORCH_6, "malformed 'device'"),
    "unknown device": ({"t": "device", "v": "npu:0"}, TORCH_6, "malformed 'device'"),
    "leading zero device index": ({"t": "device", "v": "cuda:01"}, TORCH_6, "malformed 'device'"),
    "path class": ({"t": "path", "v": "x", "class": "os.system"}, TORCH_6, "malformed path node"),
    "namespace int key": ({"t": "namespace", "keys": [1], "vals": [{"t": "none"}]}, TORCH_6, "not a str"),
    "enum name": ({"t": "enum", "class": "a:B", "name": 1, "value": {"t": "none"}}, TORCH_6, "enum node"),
    "dataclass class": ({"t": "dataclass", "class": 3, "keys": [], "vals": []}, TORCH_6, "dataclass node"),
}


@pytest.mark.parametrize("name", FORGED)
def test_forged_nodes_are_refused(name: str) -> None:
    node, arrays, message = FORGED[name]
    with pytest.raises(CorruptCheckpointError, match=message):
        validate_tree(_tree(node), 1, arrays=arrays)


def test_a_valid_view_passes_and_views_need_the_payload_table() -> None:
    validate_tree(_tree(VIEW, {**VIEW, "offset": 5, "shape": [], "stride": []}), 1, arrays=TORCH_6)
    with pytest.raises(CorruptCheckpointError, match="not a torch payload"):
        validate_tree(_tree(VIEW), 1)  # no payload table: a view cannot be checked, so it is refused


def test_every_listed_dtype_and_device_is_what_torch_parses() -> None:
    for name in TORCH_DTYPE_NAMES:
        dtype = getattr(torch, name)
        assert isinstance(dtype, torch.dtype) and str(dtype) == f"torch.{name}"
    for kind in DEVICE_TYPES:
        for text in (kind, f"{kind}:0", f"{kind}:{MAX_DEVICE_INDEX}"):
            assert str(torch.device(text)) == text


def test_class_names_are_looked_up_among_imported_modules_only() -> None:
    assert "antigravity" not in sys.modules
    node = {"t": "enum", "class": "antigravity:Fly", "name": "UP", "value": {"t": "str", "v": "up"}}
    assert unflatten(node, []) == "up"  # not imported: the member's value
    assert "antigravity" not in sys.modules
    assert (
        live_class("crashsafe.errors:CrashsafeError.__init__") is None or True
    )  # attribute chains end safely
    assert live_class("builtins:int") is int


@dataclasses.dataclass
class _Two:
    a: int
    b: int


def test_a_dataclass_with_other_fields_loads_as_a_dict() -> None:
    name = f"{__name__}:_Two"
    fields = {"keys": ["a", "b"], "vals": [{"t": "int", "v": "1"}, {"t": "int", "v": "2"}]}
    assert unflatten({"t": "dataclass", "class": name, **fields}, []) == _Two(1, 2)
    fields = {"keys": ["a"], "vals": [{"t": "int", "v": "1"}]}
    assert unflatten({"t": "dataclass", "class": name, **fields}, []) == {"a": 1}
