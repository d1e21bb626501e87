"""A point-in-time copy of a training state in one cheap walk, for saves that return at once.

``detached_copy`` flattens the state into a checked tree and rebuilds it: right for a first save,
whose errors must name their path then, but a second walk of the same structure at every later save,
while the background save flattens it again. ``fast_copy`` copies only what training could change
afterwards: arrays into staging buffers, containers rebuilt, ``state_dict()`` taken now (kept as a
:class:`~crashsafe.state.tree.StatefulCopy`, so the copy saves as the object would); immutable
values are shared. Whatever it does not know exactly gives ``None``, and the caller uses
``detached_copy`` (which refuses what cannot be stored, naming its path).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import enum
import itertools
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from crashsafe._torch import is_tensor, loaded_torch
from crashsafe.format.dtypes import torch_dtype_name
from crashsafe.state.staging import StagingPool
from crashsafe.state.tree import (
    _ARRAY_TYPES,
    MAX_DEPTH,
    ArrayLeaf,
    StatefulCopy,
    _tensor_problem,
    is_stateful,
    numpy_dtype_name,
    stateful_class,
)
from crashsafe.state.unchanged import ChangeWatch

__all__ = ["fast_copy"]

_SHARED = (type(None), bool, float, str, bytes, pathlib.PurePath, enum.Enum)  # immutable, stored as is
_ROOT = object()  # the key of the state itself
_DTYPE_NAMES: dict[Any, str] = {}  # torch dtype -> its manifest name, "" if not stored
_PLAIN = frozenset({type(None), bool, float, str, bytes})


class _Unusual(Exception):
    """A value ``fast_copy`` leaves to ``detached_copy``."""


def fast_copy(state: object, pool: StagingPool, watch: ChangeWatch | None = None) -> Any | None:
    """``state`` as ``detached_copy`` would give it (arrays in ``pool``'s staging buffers, objects
    with ``state_dict()`` as a StatefulCopy of it), or None if it holds anything ``detached_copy`` must judge:
    an unsupported or unusual value, a path two arrays would share, tensors overlapping in memory
    other than as one tensor saved twice. Tensors ``watch`` proves unchanged are not copied (their
    buffers are in the copy, but the snapshot gives ``pool.unchanged[path]`` for them)."""
    pool.begin(watch)
    walk = _Walk(pool)
    try:
        copied = walk.value(state, "", _ROOT, 0)
    except _Unusual:
        return None
    if walk.overlapping():
        return None
    walk.copy()
    pool.issue()
    pool.retain(walk.paths)
    return copied


class _Walk:
    def __init__(self, pool: StagingPool) -> None:
        self.pool = pool
        self.paths: set[str] = set()
        self.tensors: dict[tuple[Any, ...], Any] = {}  # (address, dtype, shape, stride) -> its copy
        self.spans: list[tuple[Any, int, int]] = []  # (device, start, end) of each tensor's memory
        self.copies: list[tuple[Any, Any, str]] = []  # (staged buffer, live tensor, its path)
        torch = loaded_torch()
        self.tensor_types = (torch.Tensor, torch.nn.Parameter) if torch is not None else ()
        self.torch_shared = (torch.dtype, torch.device) if torch is not None else ()

    def value(self, value: Any, parent: str, key: object, depth: int) -> Any:
        """The copy of ``value``, found at ``key`` in the container at ``parent``."""
        kind = type(value)
        if kind in _PLAIN:
            return value
        if depth > MAX_DEPTH:
            raise _Unusual
        if kind is int:
            if int.bit_length(value) >= 64:
                raise _Unusual  # flatten checks its digits
            return value
        if kind is dict:
            return self.mapping(value, _join(parent, key), depth)
        if kind in self.tensor_types:
            return self.tensor(value, _join(parent, key))
        if kind is list:
            path = _join(parent, key)
            return [self.value(v, path, i, depth + 1) for i, v in enumerate(value)]
        if kind is tuple:
            path = _join(parent, key)
            return tuple(self.value(v, path, i, depth + 1) for i, v in enumerate(value))
        return self.other(value, _join(parent, key), depth)

    def other(self, value: Any, path: str, depth: int) -> Any:
        """The copy of a value of a less common type, in ``flatten``'s order of checks."""
        if isinstance(value, (_SHARED, self.torch_shared)):
            return value
        if isinstance(value, np.generic):
            if numpy_dtype_name(value.dtype) is None:
                raise _Unusual
            return value
        if type(value) in _ARRAY_TYPES:
            name = numpy_dtype_name(value.dtype)
            if name is None:
                raise _Unusual
            return self.stage(ArrayLeaf(path, "numpy", name, tuple(value.shape), value))
        if isinstance(value, (bytearray, memoryview)):
            return bytes(value)  # a released memoryview raises here: detached_copy names it
        if is_tensor(value) or isinstance(value, (int, list, tuple, np.ndarray)):
            raise _Unusual  # subclasses: flatten decides what they become
        if isinstance(value, Mapping):
            return self.mapping(value, path, depth)
        if is_stateful(value):
            return StatefulCopy(self.other(value.state_dict(), path, depth + 1), stateful_class(value))
        if isinstance(value, argparse.Namespace):
            return argparse.Namespace(**self.other(vars(value), path, depth))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            twin = copy.copy(value)
            for field in dataclasses.fields(value):
                item = self.value(getattr(value, field.name), path, field.name, depth + 1)
                object.__setattr__(twin, field.name, item)
            return twin
        raise _Unusual

    def mapping(self, value: Mapping[Any, Any], path: str, depth: int) -> dict[Any, Any]:
        """The copy of a dict, its keys as ``flatten`` makes them (``str`` of a str subclass,
        ``int`` of an int one), in its paths too: the staging buffers are kept by them."""
        copied = {}
        for k, v in value.items():
            plain = self.key(k)
            copied[plain] = self.value(v, path, plain, depth + 1)
        return copied

    def key(self, key: Any) -> Any:
        if type(key) is str:
            return key
        if isinstance(key, str):
            return str.__str__(key)
        if isinstance(key, int) and not isinstance(key, bool) and int.bit_length(key) < 64:
            return int(key)
        raise _Unusual

    def tensor(self, tensor: Any, path: str) -> Any:
        """The copy of a plain tensor (its type is exactly Tensor or Parameter: no DTensor)."""
        if _tensor_problem(tensor) is not None:
            raise _Unusual
        dtype = tensor.dtype
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            name = _DTYPE_NAMES[dtype] = torch_dtype_name(dtype) or ""
        if not name:
            raise _Unusual
        same = (tensor.data_ptr(), dtype, tuple(tensor.shape), tensor.stride(), tensor.device)
        copied = self.tensors.get(same)
        if copied is not None:
            return copied  # one tensor saved twice (tied weights): one copy, still shared
        nbytes = tensor.nbytes
        if nbytes:
            start = same[0]
            if not tensor.is_contiguous():
                last = sum((d - 1) * s for d, s in zip(same[2], same[3], strict=True))
                nbytes = (last + 1) * tensor.itemsize
            self.spans.append((str(same[4]), start, start + nbytes))
        if path in self.paths:
            raise _Unusual  # two arrays with one dotted path: flatten refuses it
        self.paths.add(path)
        copied = self.pool.staged(path, name, same[2]) if nbytes and tensor.is_cpu else None
        if copied is not None:
            self.copies.append((copied, tensor, path))  # proven unchanged or copied at the end, in one call
        else:
            copied = self.pool.stage(ArrayLeaf(path, "torch", name, same[2], tensor))
        self.tensors[same] = copied
        return copied

    def copy(self) -> None:
        """The copies of CPU tensors into earlier buffers, but of those the pool's watch proves
        unchanged: one torch call (one release of the GIL, during which another thread could hold it
        for a switch interval). Hashed here, where they are copied, after every ``state_dict()`` the
        walk called (one may write a tensor found before it). CUDA tensors' copies were queued on the
        pool's copy streams as they were found."""
        self.pool.prehash([(path, tensor) for _, tensor, path in self.copies])
        copies = [c for c in self.copies if not self.pool.unchanged_tensor(c[2], c[1])]
        if not copies:
            return
        targets, sources, paths = zip(*copies, strict=True)
        torch = loaded_torch()
        assert torch is not None
        foreach = getattr(torch, "_foreach_copy_", None)
        with torch.no_grad():  # parameters are copied as values (cheaper than a detach() each)
            if foreach is not None:
                foreach(list(targets), list(sources))
            else:
                for target, source in zip(targets, sources, strict=True):
                    target.copy_(source)
        for path, source in zip(paths, sources, strict=True):
            self.pool.copied(path, source)

    def stage(self, leaf: ArrayLeaf) -> Any:
        if leaf.path in self.paths:
            raise _Unusual  # two arrays with one dotted path: flatten refuses it
        self.paths.add(leaf.path)
        return self.pool.stage(leaf)

    def overlapping(self) -> bool:
        """True if two different tensors share memory (a view of another): detached_copy keeps
        such views as views."""
        spans = sorted(self.spans)
        return any(a[0] == b[0] and b[1] < a[2] for a, b in itertools.pairwise(spans))


def _join(parent: str, key: object) -> str:
    """``flatten``'s dotted path of ``key`` in ``parent`` (the staging buffers are kept by it)."""
    if key is _ROOT:
        return parent
    return f"{parent}.{key}" if parent else str(key)
