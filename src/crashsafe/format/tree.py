"""The state tree of a manifest: its node types and the one validator the reader and the writer share.

Each node is a JSON object with a type tag ``t`` (docs/format.md, "The tree"). Nothing in a tree is
ever imported or executed: class names are informational, dtype and device names come from fixed
lists, and a view's shape, strides and offset are checked against the array it looks into.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from crashsafe.format.checks import MAX_INT64, MAX_NDIM, MIN_INT64, bad, checked_int, member, show

__all__ = [
    "ARRAY_NODES",
    "DEVICE_TYPES",
    "MAX_DEVICE_INDEX",
    "MAX_INT_DIGITS",
    "MAX_TREE_DEPTH",
    "MAX_TREE_NODES",
    "PATH_CLASSES",
    "TORCH_DTYPE_NAMES",
    "ArrayInfo",
    "TreeCheck",
    "validate_tree",
]

ARRAY_NODES = ("array", "view")  # tree nodes that point at a payload by its index
MAX_TREE_DEPTH = 200
MAX_TREE_NODES = 1_000_000
MAX_INT_DIGITS = 4300  # Python's default int/str conversion limit
# torch.dtype names (str(dtype) without "torch."): a dtype node may name only these.
TORCH_DTYPE_NAMES = frozenset({
    "bfloat16", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "complex128", "complex32",
    "complex64", "float16", "float32", "float4_e2m1fn_x2", "float64", "float8_e4m3fn", "float8_e4m3fnuz",
    "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "int1", "int16", "int2", "int3", "int32", "int4",
    "int5", "int6", "int64", "int7", "int8", "qint32", "qint8", "quint2x4", "quint4x2", "quint8",
    "uint1", "uint16", "uint2", "uint3", "uint32", "uint4", "uint5", "uint6", "uint64", "uint7", "uint8"
})  # fmt: skip
# torch.device types every torch build parses ("privateuseone" is renamed by the backend that uses it).
DEVICE_TYPES = frozenset({
    "cpu", "cuda", "fpga", "hip", "hpu", "ideep", "ipu", "lazy", "maia", "meta", "mps", "mtia", "opencl",
    "opengl", "ve", "vulkan", "xla", "xpu"
})  # fmt: skip
MAX_DEVICE_INDEX = 127  # torch keeps a device index in an int8: "cuda:200" would parse as another device
PATH_CLASSES = frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"})
ArrayInfo = tuple[str, tuple[int, ...]]  # a payload's kind and shape: what a view node is checked against

_INT_TEXT = re.compile(rf"-?[0-9]{{1,{MAX_INT_DIGITS}}}")
_DEVICE = re.compile(r"([a-z]+)(?::(0|[1-9][0-9]{0,2}))?")


def _is_bool(v: object) -> bool:
    return isinstance(v, bool)


def _is_str(v: object) -> bool:
    return isinstance(v, str)


def _is_int_text(v: object) -> bool:
    """Canonical decimal only: ``int()`` would also take " 1_0 " or more digits than it prints."""
    return isinstance(v, str) and _INT_TEXT.fullmatch(v) is not None


def _is_float_text(v: object) -> bool:
    if not isinstance(v, str):
        return False
    try:
        float.fromhex(v)
    except (ValueError, OverflowError):  # "0x1p99999" overflows
        return False
    return True


def _is_dtype_name(v: object) -> bool:
    return member(v, TORCH_DTYPE_NAMES)


def _is_device_text(v: object) -> bool:
    """What ``str(torch.device)`` gives: a known type, then optionally ``:index`` in canonical decimal."""
    match = _DEVICE.fullmatch(v) if isinstance(v, str) else None
    if match is None or match.group(1) not in DEVICE_TYPES:
        return False
    return match.group(2) is None or int(match.group(2)) <= MAX_DEVICE_INDEX


_NODE_FIELDS: dict[str, frozenset[str]] = {
    "none": frozenset({"t"}),
    "bool": frozenset({"t", "v"}),
    "int": frozenset({"t", "v"}),
    "float": frozenset({"t", "v"}),
    "str": frozenset({"t", "v"}),
    "dtype": frozenset({"t", "v"}),
    "device": frozenset({"t", "v"}),
    "path": frozenset({"t", "v", "class"}),
    "array": frozenset({"t", "id"}),
    "view": frozenset({"t", "id", "offset", "shape", "stride"}),
    "dict": frozenset({"t", "keys", "vals"}),
    "namespace": frozenset({"t", "keys", "vals"}),
    "dataclass": frozenset({"t", "class", "keys", "vals"}),
    "list": frozenset({"t", "items"}),
    "tuple": frozenset({"t", "items"}),
    "stateful": frozenset({"t", "class", "value"}),
    "enum": frozenset({"t", "class", "name", "value"}),
}
_SCALAR_VALUES: dict[str, Callable[[object], bool]] = {
    "bool": _is_bool,
    "int": _is_int_text,
    "float": _is_float_text,
    "str": _is_str,
    "dtype": _is_dtype_name,
    "device": _is_device_text,
}


def validate_tree(
    tree: object, n_payloads: int, where: str = "state tree", arrays: Sequence[ArrayInfo] | None = None
) -> None:
    """Raise CorruptCheckpointError unless ``tree`` is a state tree the reader accepts, using each
    of ``n_payloads`` arrays exactly once. View nodes need ``arrays`` (each payload's kind and shape)
    to be checked. The writer runs it too, so what saves also loads."""
    check = TreeCheck(n_payloads, where, arrays)
    check.node(tree, 0)
    if len(check.used) != n_payloads:
        raise bad(where, "lists payloads that its tree never uses")


class TreeCheck:
    """One walk over a tree: counts nodes (at most MAX_TREE_NODES), records the arrays used."""

    def __init__(self, n_payloads: int, where: str, arrays: Sequence[ArrayInfo] | None = None) -> None:
        self.n_payloads = n_payloads
        self.where = where
        self.arrays = arrays
        self.used: set[int] = set()
        self.nodes = 0

    def node(self, node: object, depth: int) -> None:
        self.nodes += 1
        if self.nodes > MAX_TREE_NODES:
            raise bad(self.where, f"has more than {MAX_TREE_NODES} tree nodes")
        if depth > MAX_TREE_DEPTH:
            raise bad(self.where, f"has a state tree deeper than {MAX_TREE_DEPTH}")
        t = node.get("t") if isinstance(node, dict) else None
        if not isinstance(t, str) or t not in _NODE_FIELDS:
            raise bad(self.where, f"has an invalid tree node {show(node)}")
        assert isinstance(node, dict)
        if node.keys() != _NODE_FIELDS[t]:
            raise bad(self.where, f"has a malformed {t!r} tree node")
        if t == "array":
            self.array(node["id"])
        elif t in _SCALAR_VALUES:
            if not _SCALAR_VALUES[t](node["v"]):
                raise bad(self.where, f"has a malformed {t!r} value {show(node['v'])}")
        elif t in ("dict", "namespace", "dataclass"):
            if t == "dataclass" and not isinstance(node["class"], str):
                raise bad(self.where, "has a malformed dataclass node")
            for child in _dict_values(node["keys"], node["vals"], self.where, str_keys=t != "dict"):
                self.node(child, depth + 1)
        elif t in ("stateful", "enum"):
            if not isinstance(node["class"], str) or (t == "enum" and not isinstance(node["name"], str)):
                raise bad(self.where, f"has a malformed {t} node")
            self.node(node["value"], depth + 1)
        elif t in ("list", "tuple"):
            if not isinstance(node["items"], list):
                raise bad(self.where, f"has a malformed {t} node")
            for child in node["items"]:
                self.node(child, depth + 1)
        elif t == "path":
            if not isinstance(node["v"], str) or not member(node["class"], PATH_CLASSES):
                raise bad(self.where, f"has a malformed path node {show(node)}")
        elif t == "view":
            self.view(node)

    def array(self, node_id: object) -> None:
        idx = checked_int(node_id, "array id", self.where)
        if idx >= self.n_payloads or idx in self.used:
            raise bad(self.where, f"has an array id {show(idx)} that is out of range or used twice")
        self.used.add(idx)

    def view(self, node: dict[str, Any]) -> None:
        """A view into a torch payload: no more elements than the payload, every one inside it."""
        idx = checked_int(node["id"], "view id", self.where)
        if self.arrays is None or idx >= len(self.arrays) or self.arrays[idx][0] != "torch":
            raise bad(self.where, f"has a view of {show(idx)}, which is not a torch payload of this tree")
        offset = checked_int(node["offset"], "view offset", self.where)
        shape, stride = node["shape"], node["stride"]
        if not isinstance(shape, list) or not isinstance(stride, list) or len(shape) != len(stride):
            raise bad(self.where, f"has a view with shape {show(shape)} and strides {show(stride)}")
        if len(shape) > MAX_NDIM:
            raise bad(self.where, f"has a view of more than {MAX_NDIM} dimensions")
        for d, s in zip(shape, stride, strict=True):
            checked_int(d, "view dimension", self.where)
            checked_int(s, "view stride", self.where)
        size = math.prod(self.arrays[idx][1])
        last = offset + sum((d - 1) * s for d, s in zip(shape, stride, strict=True))
        if math.prod(shape) > size or (math.prod(shape) and last >= size):
            raise bad(self.where, f"has a view of payload {idx} ({size} elements) reaching outside it")


def _dict_values(keys: object, vals: object, where: str, str_keys: bool = False) -> list[object]:
    """The values of a dict-like node whose keys are unique strs (or, for dicts, int64 ints)."""
    if not isinstance(keys, list) or not isinstance(vals, list) or len(keys) != len(vals):
        raise bad(where, "has a malformed dict node")
    for k in keys:
        if not isinstance(k, str) and (
            str_keys or isinstance(k, bool) or not isinstance(k, int) or not MIN_INT64 <= k <= MAX_INT64
        ):
            raise bad(where, f"has a key {show(k)} that is not a str{'' if str_keys else ' or an int64'}")
    if len(set(keys)) != len(keys):
        raise bad(where, "has a dict node with duplicate keys")
    return vals
