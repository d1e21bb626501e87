"""Nested training state <-> a JSON tree plus a flat list of array leaves.

The tree keeps containers, python scalars and the position of every array; arrays (torch tensors,
numpy arrays, numpy scalars, bytes) become :class:`ArrayLeaf` records whose bytes go to payloads.
Anything else is refused with an error naming its path in the state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from crashsafe._torch import is_tensor, loaded_torch
from crashsafe.errors import UnsupportedStateError
from crashsafe.format.dtypes import DTYPES, torch_dtype_name

__all__ = [
    "ArrayLeaf",
    "LeafKind",
    "Stateful",
    "flatten",
    "format_path",
    "is_stateful",
    "numpy_dtype_name",
]

LeafKind = Literal["torch", "numpy", "npscalar", "bytes"]
MAX_DEPTH = 64


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()``/``load_state_dict()``: modules, optimizers, schedulers."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


@dataclass(frozen=True)
class ArrayLeaf:
    """One array-like value of the state, still pointing at the live object."""

    path: str
    kind: LeafKind
    dtype: str
    shape: tuple[int, ...]
    source: Any

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def is_stateful(value: object) -> bool:
    """True for objects crashsafe saves through their ``state_dict()``."""
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def format_path(parts: tuple[str | int, ...]) -> str:
    """Dotted display path of a position in the state, e.g. ``optim.state.0.exp_avg``."""
    return ".".join(str(p) for p in parts) if parts else "<root>"


def numpy_dtype_name(dtype: np.dtype[Any]) -> str | None:
    """Manifest name of a numpy dtype, or None for object/str/structured dtypes."""
    native = dtype.newbyteorder("=")
    name = native.name
    return name if name in DTYPES and DTYPES[name] == native else None


def flatten(state: object) -> tuple[dict[str, Any], list[ArrayLeaf]]:
    """Split ``state`` into a JSON-serialisable tree and its array leaves, in tree order."""
    leaves: list[ArrayLeaf] = []
    tree = _flatten(state, (), leaves, 0)
    return tree, leaves


def _refuse(parts: tuple[str | int, ...], message: str) -> UnsupportedStateError:
    return UnsupportedStateError(f"state at '{format_path(parts)}': {message}")


def _flatten(
    value: object, parts: tuple[str | int, ...], leaves: list[ArrayLeaf], depth: int
) -> dict[str, Any]:
    if depth > MAX_DEPTH:
        raise _refuse(parts, f"nesting deeper than {MAX_DEPTH} levels (a cycle?)")
    if value is None:
        return {"t": "none"}
    if isinstance(value, bool):
        return {"t": "bool", "v": value}
    if isinstance(value, int):
        return {"t": "int", "v": str(value)}
    if isinstance(value, float):
        return {"t": "float", "v": value.hex()}
    if isinstance(value, str):
        return {"t": "str", "v": value}
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return _leaf(ArrayLeaf(format_path(parts), "bytes", "uint8", (len(data),), data), leaves)
    if is_tensor(value):
        return _tensor_leaf(value, parts, leaves)
    if isinstance(value, np.ndarray):
        return _numpy_leaf(value, parts, leaves, "numpy")
    if isinstance(value, np.generic):
        return _numpy_leaf(np.asarray(value), parts, leaves, "npscalar")
    if isinstance(value, Mapping):
        keys: list[str | int] = []
        vals: list[dict[str, Any]] = []
        for key, item in value.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise _refuse(
                    parts,
                    f"dict key {key!r} is a {type(key).__name__}; only str and int keys can be checkpointed",
                )
            keys.append(key)
            vals.append(_flatten(item, (*parts, key), leaves, depth + 1))
        return {"t": "dict", "keys": keys, "vals": vals}
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        items = [_flatten(v, (*parts, i), leaves, depth + 1) for i, v in enumerate(value)]
        return {"t": kind, "items": items}
    if is_stateful(value):
        cls = type(value)
        inner = _flatten(value.state_dict(), parts, leaves, depth + 1)  # type: ignore[attr-defined]
        return {"t": "stateful", "class": f"{cls.__module__}.{cls.__qualname__}", "value": inner}
    raise _refuse(
        parts,
        f"cannot checkpoint a {type(value).__module__}.{type(value).__qualname__}. Supported: "
        "torch tensors, numpy arrays, python scalars/str/bytes/None, dict/list/tuple, and objects "
        "with state_dict()/load_state_dict(). Wrap other objects in such a class.",
    )


def _leaf(leaf: ArrayLeaf, leaves: list[ArrayLeaf]) -> dict[str, Any]:
    leaves.append(leaf)
    return {"t": "array", "id": len(leaves) - 1}


def _tensor_leaf(tensor: Any, parts: tuple[str | int, ...], leaves: list[ArrayLeaf]) -> dict[str, Any]:
    torch = loaded_torch()
    assert torch is not None
    if tensor.layout != torch.strided:
        raise _refuse(parts, f"{tensor.layout} tensors are not supported; call .to_dense() first")
    if tensor.is_quantized:
        raise _refuse(parts, "quantized tensors are not supported; dequantize() first")
    name = torch_dtype_name(tensor.dtype)
    if name is None:
        raise _refuse(parts, f"tensor dtype {tensor.dtype} is not supported")
    return _leaf(ArrayLeaf(format_path(parts), "torch", name, tuple(tensor.shape), tensor), leaves)


def _numpy_leaf(
    array: np.ndarray[Any, Any], parts: tuple[str | int, ...], leaves: list[ArrayLeaf], kind: LeafKind
) -> dict[str, Any]:
    name = numpy_dtype_name(array.dtype)
    if name is None:
        raise _refuse(
            parts,
            f"numpy dtype {array.dtype} is not supported (object, string and "
            "structured arrays could execute or hide code; store numbers or bytes)",
        )
    return _leaf(ArrayLeaf(format_path(parts), kind, name, tuple(array.shape), array), leaves)
