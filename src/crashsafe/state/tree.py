"""Nested training state <-> a JSON tree plus a flat list of array leaves.

The tree keeps containers, python scalars and the position of every array; arrays (torch tensors,
numpy arrays, numpy scalars, bytes) become :class:`ArrayLeaf` records whose bytes go to payloads.
Anything else is refused with an error naming its path in the state. What ``flatten`` accepts,
the reader accepts: the tree goes through the reader's own validator before anything is written.
See ``docs/state.md`` for what comes back exactly and what comes back changed.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import math
import pathlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast, runtime_checkable

import numpy as np

from crashsafe._torch import is_tensor, loaded_torch
from crashsafe.errors import CorruptCheckpointError, UnsupportedStateError
from crashsafe.format.dtypes import DTYPES, torch_dtype_name
from crashsafe.format.tree import validate_tree
from crashsafe.state.shared import find_views

__all__ = [
    "ArrayLeaf",
    "LeafKind",
    "Shard",
    "Stateful",
    "StatefulCopy",
    "class_name",
    "flatten",
    "format_path",
    "is_dtensor",
    "is_stateful",
    "local_shard",
    "numpy_dtype_name",
    "stateful_class",
]

LeafKind = Literal["torch", "numpy", "npscalar", "bytes"]
Parts = tuple[str | int, ...]
MAX_DEPTH = 64
# Python refuses int("...") beyond this many digits by default, so a reader could not parse more.
MAX_INT_DIGITS = sys.int_info.default_max_str_digits
_MAX_INT_BITS = math.ceil(MAX_INT_DIGITS * math.log2(10))
_ARRAY_TYPES = (np.ndarray, np.memmap)  # plain arrays: subclasses may carry more than their data


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()``/``load_state_dict()``: modules, optimizers, schedulers."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


@dataclass(frozen=True)
class Shard:
    """Where a local shard sits in its global tensor: the global shape and the shard's offsets
    (and, to rebuild a live DTensor on restore, its device mesh and placements)."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    mesh: Any = field(default=None, compare=False, repr=False)
    placements: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ArrayLeaf:
    """One array-like value of the state, still pointing at the live object."""

    path: str
    kind: LeafKind
    dtype: str
    shape: tuple[int, ...]
    source: Any
    shard: Shard | None = None  # a DTensor's local part: where it sits in the global tensor

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class StatefulCopy:
    """A copy of an object's ``state_dict()``, saved as the object itself is (a ``stateful`` node
    naming its class): what :func:`~crashsafe.state.snapshot.fast_copy` makes of a module or optimizer."""

    state: Any
    class_name: str  # module.qualname of the object copied

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state_dict: Any) -> None:
        raise TypeError("a StatefulCopy is a snapshot to save, not an object to load into")


def is_stateful(value: object) -> bool:
    """True for objects crashsafe saves through their ``state_dict()``."""
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def stateful_class(value: object) -> str:
    """``module.qualname`` of a stateful object, as its tree node records it (a copy's original)."""
    if isinstance(value, StatefulCopy):
        return value.class_name
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"


def format_path(parts: Parts) -> str:
    """Dotted display path of a position in the state, e.g. ``optim.state.0.exp_avg``."""
    return ".".join(str(p) for p in parts) if parts else "<root>"


def numpy_dtype_name(dtype: np.dtype[Any]) -> str | None:
    """Manifest name of a numpy dtype, or None for object/str/structured dtypes."""
    native = dtype.newbyteorder("=")
    name = native.name
    return name if name in DTYPES and DTYPES[name] == native else None


def flatten(state: object, *, check: bool = True) -> tuple[dict[str, Any], list[ArrayLeaf]]:
    """Split ``state`` into a JSON-serialisable tree and its array leaves, in tree order.

    Raises UnsupportedStateError for anything a checkpoint could not give back: unsupported
    values, two arrays with the same dotted path, and, with ``check``, any tree the reader's
    validator refuses (without: a background save, whose writer runs that validator anyway).
    """
    walk = _Walk()
    tree = walk.node(state, (), 0)
    leaves = walk.share_views()
    if not check:
        return tree, leaves
    try:
        validate_tree(tree, len(leaves), arrays=[(leaf.kind, leaf.shape) for leaf in leaves])
    except CorruptCheckpointError as exc:
        raise UnsupportedStateError(
            f"this state would make a checkpoint crashsafe cannot read back: {exc}. Change that part "
            "of the state; docs/state.md lists what a checkpoint can hold"
        ) from None
    return tree, leaves


def _refuse(parts: Parts, message: str) -> UnsupportedStateError:
    return UnsupportedStateError(f"state at '{format_path(parts)}': {message}")


def _position(parts: Parts) -> str:
    """Unambiguous position in the state, e.g. ``state['opt'][0]`` vs ``state['opt']['0']``."""
    return "state" + "".join(f"[{p!r}]" for p in parts)


def _type_name(value: object) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def class_name(cls: type) -> str:
    """``module:qualname`` of a class, as enum and dataclass nodes record it (never imported)."""
    return f"{cls.__module__}:{cls.__qualname__}"


class _Walk:
    """One flatten: the array leaves found so far and the position that owns each dotted path."""

    def __init__(self) -> None:
        self.leaves: list[ArrayLeaf] = []
        self.arrays: list[dict[str, Any]] = []  # the tree node of each leaf
        self._owners: dict[str, Parts] = {}
        self.tensor_types = _torch_types()[0] if loaded_torch() is not None else ()

    def node(self, value: object, parts: Parts, depth: int) -> dict[str, Any]:
        """Tree node of ``value`` at ``parts``; its arrays are appended to ``leaves``."""
        if depth > MAX_DEPTH:
            raise _refuse(parts, f"nesting deeper than {MAX_DEPTH} levels (a cycle?)")
        kind, exact = type(value), cast(Any, value)  # common exact types first, as the checks below take them
        if kind is dict:
            return self._dict(exact, parts, depth)
        if kind is str:
            return {"t": "str", "v": exact}
        if kind is float:
            return {"t": "float", "v": float.hex(exact)}
        if kind is int:
            return {"t": "int", "v": _int_text(exact, parts)}
        if kind in self.tensor_types:
            return self._tensor(exact, parts)
        if value is None:
            return {"t": "none"}
        if isinstance(value, bool):
            return {"t": "bool", "v": value}
        if isinstance(value, np.generic) and numpy_dtype_name(value.dtype) is not None:
            return self._array(np.asarray(value), parts, "npscalar")  # before float: np.float64 stays
        if isinstance(value, int):
            return {"t": "int", "v": _int_text(value, parts)}
        if isinstance(value, float):
            return {"t": "float", "v": float.hex(value)}
        if isinstance(value, str):
            return {"t": "str", "v": str.__str__(value)}  # a str subclass (enum, np.str_) as plain str
        if isinstance(value, (bytes, bytearray, memoryview)):
            try:
                data = bytes(value)
            except ValueError as exc:  # a released memoryview
                raise _refuse(parts, f"cannot read its bytes ({exc})") from None
            return self._leaf(parts, "bytes", "uint8", (len(data),), data)
        if is_tensor(value):
            return self._tensor(value, parts)
        if isinstance(value, (np.ndarray, np.generic)):
            return self._array(value, parts, "numpy")
        if isinstance(value, Mapping):
            return self._dict(value, parts, depth)
        if isinstance(value, (list, tuple)):
            items = [self.node(v, (*parts, i), depth + 1) for i, v in enumerate(value)]
            return {"t": "list" if isinstance(value, list) else "tuple", "items": items}
        if is_stateful(value):
            return self._stateful(value, parts, depth)
        return self._value(value, parts, depth)

    def share_views(self) -> list[ArrayLeaf]:
        """Turn tensors that look into another saved tensor's memory into view nodes of it (tied
        weights are stored once); return the leaves left, their array ids renumbered in order."""
        found = find_views([leaf.source if leaf.kind == "torch" and leaf.shard is None else None
                            for leaf in self.leaves])  # fmt: skip
        if not found:
            return self.leaves
        kept = [i for i in range(len(self.leaves)) if i not in found]
        new_id = {old: new for new, old in enumerate(kept)}
        for old, node in enumerate(self.arrays):
            if old in new_id:
                node["id"] = new_id[old]
            else:
                view = found[old]
                node.clear()
                node.update(t="view", id=new_id[view.anchor], offset=view.offset,
                            shape=list(view.shape), stride=list(view.stride))  # fmt: skip
        return [self.leaves[i] for i in kept]

    def _value(self, value: object, parts: Parts, depth: int) -> dict[str, Any]:
        """Tree node of the plain values frameworks put in checkpoints (torch dtypes and devices,
        paths, argparse namespaces, enum members, dataclasses); refuse anything else."""
        torch = loaded_torch()
        if torch is not None and isinstance(value, torch.dtype):
            return {"t": "dtype", "v": str(value).removeprefix("torch.")}
        if torch is not None and isinstance(value, torch.device):
            return {"t": "device", "v": str(value)}
        if isinstance(value, pathlib.PurePath):
            return {"t": "path", "v": str(value), "class": _path_class(value)}
        if isinstance(value, argparse.Namespace):
            keys, vals = self._fields(vars(value), parts, depth)
            return {"t": "namespace", "keys": keys, "vals": vals}
        if isinstance(value, enum.Enum):
            try:
                inner = self.node(value.value, parts, depth + 1)
            except UnsupportedStateError as exc:
                member = f"{_type_name(value)}.{value.name}"
                raise UnsupportedStateError(f"{exc} (the value of {member})") from None
            return {"t": "enum", "class": class_name(type(value)), "name": value.name, "value": inner}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
            keys, vals = self._fields(fields, parts, depth)
            return {"t": "dataclass", "class": class_name(type(value)), "keys": keys, "vals": vals}
        raise _refuse(
            parts,
            f"cannot checkpoint a {_type_name(value)}. Supported: torch tensors, numpy arrays, python "
            "scalars/str/bytes/None, dict/list/tuple, torch dtypes and devices, paths, argparse "
            "namespaces, enum members, dataclasses of these, and objects with "
            "state_dict()/load_state_dict(). Wrap other objects in such a class.",
        )

    def _fields(
        self, fields: Mapping[str, Any], parts: Parts, depth: int
    ) -> tuple[list[str], list[dict[str, Any]]]:
        """Names and nodes of a namespace's attributes or a dataclass's fields."""
        names = [str.__str__(name) for name in fields]
        nodes = [self.node(v, (*parts, n), depth + 1) for n, v in zip(names, fields.values(), strict=True)]
        return names, nodes

    def _dict(self, value: Mapping[Any, Any], parts: Parts, depth: int) -> dict[str, Any]:
        keys: list[str | int] = []
        vals: list[dict[str, Any]] = []
        for key, item in value.items():
            plain = key if type(key) is str else _plain_key(key, parts)  # fast path: most keys
            keys.append(plain)
            vals.append(self.node(item, (*parts, plain), depth + 1))
        return {"t": "dict", "keys": keys, "vals": vals}

    def _stateful(self, value: Any, parts: Parts, depth: int) -> dict[str, Any]:
        try:
            state = value.state_dict()
        except Exception as exc:
            raise _refuse(parts, f"{_type_name(value)}.state_dict() raised {exc!r}") from exc
        inner = self.node(state, parts, depth + 1)
        return {"t": "stateful", "class": stateful_class(value), "value": inner}

    def _tensor(self, tensor: Any, parts: Parts) -> dict[str, Any]:
        shard = None
        if is_dtensor(tensor):
            tensor, shard = local_shard(tensor, parts)
        problem = _tensor_problem(tensor)
        if problem is not None:
            raise _refuse(parts, problem)
        name = torch_dtype_name(tensor.dtype)
        if name is None:
            raise _refuse(parts, f"tensor dtype {tensor.dtype} is not supported")
        return self._leaf(parts, "torch", name, tuple(tensor.shape), tensor, shard)

    def _array(self, array: Any, parts: Parts, kind: LeafKind) -> dict[str, Any]:
        name = numpy_dtype_name(array.dtype)
        if name is None:
            raise _refuse(
                parts,
                f"numpy dtype {array.dtype} is not supported (object, string and "
                "structured arrays could execute or hide code; store numbers or bytes)",
            )
        if type(array) not in _ARRAY_TYPES:
            raise _refuse(
                parts,
                f"a {_type_name(array)} is a numpy.ndarray subclass; crashsafe stores plain arrays and "
                "would drop what the subclass adds (a masked array's mask, a unit, ...). Save "
                "np.asarray(x) and the extra parts (e.g. x.mask) as separate values",
            )
        return self._leaf(parts, kind, name, tuple(array.shape), array)

    def _leaf(
        self,
        parts: Parts,
        kind: LeafKind,
        dtype: str,
        shape: tuple[int, ...],
        source: Any,
        shard: Shard | None = None,
    ) -> dict[str, Any]:
        path = format_path(parts)
        owner = self._owners.setdefault(path, parts)
        if owner != parts:
            raise UnsupportedStateError(
                f"{_position(owner)} and {_position(parts)} would both be saved as '{path}': "
                "crashsafe names arrays by their dotted path and could not tell them apart. "
                "Rename one of the keys"
            )
        self.leaves.append(ArrayLeaf(path, kind, dtype, shape, source, shard))
        self.arrays.append({"t": "array", "id": len(self.leaves) - 1})
        return self.arrays[-1]


def _int_text(value: int, parts: Parts) -> str:
    """Plain decimal text of an int; an int subclass (IntEnum member) gives its integer value."""
    bits = int.bit_length(value)
    if bits < 64:  # fast path: most ints, far below any digit limit
        return int.__repr__(value)
    if bits <= _MAX_INT_BITS:  # bounded work even if this process lifted the limit
        try:
            text = int.__repr__(value)
        except ValueError:  # this process limits int -> str further
            pass
        else:
            if len(text) - (value < 0) <= MAX_INT_DIGITS:
                return text
    raise _refuse(
        parts,
        f"an int with more than {MAX_INT_DIGITS} decimal digits cannot be checkpointed (python "
        "refuses to read it back); store it as bytes, e.g. x.to_bytes((x.bit_length() + 8) // 8, "
        "'little', signed=True)",
    )


def _path_class(path: pathlib.PurePath) -> str:
    """The pathlib class a path is saved as: its own, or the one it derives from."""
    for cls in (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath):
        if isinstance(path, cls):
            return cls.__name__
    return "PureWindowsPath"  # every other PurePath is one


def _plain_key(key: object, parts: Parts) -> str | int:
    """A dict key as the plain str or int it is saved as (enum members give their value)."""
    if isinstance(key, str):
        return str.__str__(key)
    if isinstance(key, int) and not isinstance(key, bool):
        return int(_int_text(key, parts))
    raise _refuse(
        parts, f"dict key {key!r} is a {type(key).__name__}; only str and int keys can be checkpointed"
    )


@functools.cache
def _torch_types() -> tuple[tuple[type, ...], type, Any]:
    """Tensor types saved as they are, the lazy-parameter mixin, the strided layout (looked up once)."""
    torch = loaded_torch()
    assert torch is not None
    return (torch.Tensor, torch.nn.Parameter), torch.nn.parameter.UninitializedTensorMixin, torch.strided


def is_dtensor(tensor: Any) -> bool:
    """A DTensor (torch.distributed's sharded tensor), without importing torch.distributed."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_shard(tensor: Any, parts: Parts) -> tuple[Any, Shard]:
    """A DTensor's local tensor and where it sits in the global one (what a rank saves of it)."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(isinstance(p, Partial) for p in tensor.placements):
        raise _refuse(parts, "a DTensor with a Partial placement holds unreduced sums; redistribute it first")
    local = tensor.to_local()
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(shape) != tuple(local.shape):
        raise _refuse(parts, f"a DTensor's local tensor {tuple(local.shape)} is not its shard {tuple(shape)}")
    offset = tuple(int(o) for o in offset)
    return local, Shard(tuple(tensor.shape), offset, tensor.device_mesh, tensor.placements)


def _tensor_problem(tensor: Any) -> str | None:
    """Why ``tensor`` could not be saved and given back as it is, or None if it can."""
    plain, lazy, strided = _torch_types()
    if isinstance(tensor, lazy):
        return (
            "an uninitialized lazy parameter or buffer has no shape or data yet; run a forward pass "
            "(or restore into the module) before saving it"
        )
    if tensor.is_nested:
        return "nested tensors are not supported; save tensor.unbind() (a tuple of tensors) instead"
    if type(tensor) not in plain:
        return (
            f"a {_type_name(tensor)} is a torch.Tensor subclass; crashsafe stores plain tensors and "
            "would drop what the subclass adds. Convert it to a plain tensor first (e.g. "
            "t.as_subclass(torch.Tensor) if it only adds methods, t.full_tensor() for a DTensor)"
        )
    if tensor.layout != strided:
        return f"{tensor.layout} tensors are not supported; call .to_dense() first"
    if tensor.is_quantized:
        return "quantized tensors are not supported; dequantize() first"
    if tensor.is_meta:
        return (
            "a meta tensor has no data; materialize it (e.g. module.to_empty(device='cpu'), then "
            "initialise or load it) before saving"
        )
    return None
