"""Which tensors and values differ between two committed steps, and by how much.

Both steps are read the way ``CheckpointManager.load`` reads them (checksums verified, delta chains
and references to earlier steps' bytes followed, any store, a distributed step as whole tensors), so
a diff shows what a restore would get.
Each path of either state gets one :class:`PathDiff`: only in A, only in B, dtype or shape changed,
bit-identical, or different with the count of changed elements and the max/mean absolute difference.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from crashsafe.errors import NoCheckpointError
from crashsafe.manager import CheckpointManager
from crashsafe.state.tree import format_path, numpy_dtype_name

__all__ = ["STATUSES", "PathDiff", "StepDiff", "compare_states", "diff_steps"]

Status = Literal["identical", "differs", "only_a", "only_b", "dtype_changed", "shape_changed"]
STATUSES: tuple[Status, ...] = ("identical", "differs", "only_a", "only_b", "dtype_changed", "shape_changed")
_CHUNK = 1 << 20  # elements compared at a time: bounded temporaries whatever the tensor's size
Kind = Literal["tensor", "value"]
_Leaf = tuple[Kind, str, Any]  # (kind, dtype or python type name, the array or the value)


@dataclass(frozen=True)
class PathDiff:
    """How one path of the state differs between step A and step B (None where it does not apply).

    ``changed`` counts elements whose values differ (NaN equals NaN); ``max_abs`` and ``mean_abs``
    are over the elements finite on both sides; ``nonfinite`` counts changed elements where a side
    is NaN or infinite. Python values (``kind="value"``) have no shape and count as one element.
    """

    path: str
    status: Status
    kind: Kind
    dtype_a: str | None = None
    dtype_b: str | None = None
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    changed: int | None = None
    nonfinite: int | None = None
    max_abs: float | None = None
    mean_abs: float | None = None
    value_a: Any = None
    value_b: Any = None


@dataclass(frozen=True)
class StepDiff:
    """Every path of two steps, A's order first, then the paths only B has."""

    location_a: str
    step_a: int
    location_b: str
    step_b: int
    paths: tuple[PathDiff, ...]

    @property
    def identical(self) -> bool:
        """True when both steps hold the same paths with bit-identical contents."""
        return all(p.status == "identical" for p in self.paths)

    @property
    def counts(self) -> dict[Status, int]:
        """How many paths have each status (every status listed, zeros included)."""
        return {s: sum(p.status == s for p in self.paths) for s in STATUSES}

    @property
    def max_abs(self) -> float:
        """The largest absolute difference of any path (0.0 when none is numeric and different)."""
        return max((p.max_abs for p in self.paths if p.max_abs is not None), default=0.0)


def diff_steps(
    location_a: str | os.PathLike[str],
    step_a: int | None = None,
    location_b: str | os.PathLike[str] | None = None,
    step_b: int | None = None,
    *,
    prefixes: Sequence[str] = (),
    storage_options: Mapping[str, Any] | None = None,
) -> StepDiff:
    """Compare ``step_a`` of ``location_a`` with ``step_b`` of ``location_b`` (default: the same
    location); a step of None is that location's newest. Only paths starting with one of
    ``prefixes`` are compared, if any are given. Both states are held in memory at once."""
    where_b = location_a if location_b is None else location_b
    found_a, leaves_a = _read(location_a, step_a, storage_options)
    found_b, leaves_b = _read(where_b, step_b, storage_options)
    paths = [
        d
        for d in compare_states(leaves_a, leaves_b)
        if not prefixes or any(d.path.startswith(p) for p in prefixes)
    ]
    return StepDiff(os.fspath(location_a), found_a, os.fspath(where_b), found_b, tuple(paths))


def _read(
    location: str | os.PathLike[str], step: int | None, options: Mapping[str, Any] | None
) -> tuple[int, dict[str, _Leaf]]:
    """(step, leaves) of one step, read as ``load`` reads it; dtype names from its manifest (a
    bfloat16 tensor reads back as uint16 bits without torch)."""
    mgr = CheckpointManager(location, read_only=True, storage_options=options)
    with mgr:
        if step is None:
            step = mgr.latest_step()
            if step is None:
                raise NoCheckpointError(
                    f"no committed checkpoint in {os.fspath(location)}; nothing to compare"
                )
        dtypes = {p.path: p.dtype for p in mgr.manifest(step).payloads}
        state = mgr.load(step, numpy=True)
    return step, {path: leaf for path, leaf in _leaves(state, (), dtypes)}


def _leaves(
    value: Any, parts: tuple[str | int, ...], dtypes: Mapping[str, str]
) -> Iterator[tuple[str, _Leaf]]:
    """(path, leaf) for every array and python value of a loaded state, in tree order."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*parts, key), dtypes)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _leaves(item, (*parts, i), dtypes)
    else:
        path = format_path(parts)
        if isinstance(value, bytes):
            value = np.frombuffer(value, dtype=np.uint8)
        if isinstance(value, (np.ndarray, np.generic)):
            array = np.asarray(value)
            yield (
                path,
                ("tensor", dtypes.get(path) or numpy_dtype_name(array.dtype) or str(array.dtype), array),
            )
        else:
            yield path, ("value", "none" if value is None else type(value).__name__, value)


def compare_states(a: Mapping[str, _Leaf], b: Mapping[str, _Leaf]) -> list[PathDiff]:
    """One :class:`PathDiff` per path of ``a`` or ``b`` (leaves as :func:`diff_steps` reads them)."""
    out = [_compare(path, leaf, b.get(path)) for path, leaf in a.items()]
    out += [_only(path, leaf, "only_b") for path, leaf in b.items() if path not in a]
    return out


def _only(path: str, leaf: _Leaf, status: Status) -> PathDiff:
    kind, dtype, value = leaf
    shape = tuple(value.shape) if kind == "tensor" else None
    side = "a" if status == "only_a" else "b"
    fields: dict[str, Any] = {f"dtype_{side}": dtype, f"shape_{side}": shape}
    if kind == "value":
        fields[f"value_{side}"] = value
    return PathDiff(path, status, kind, **fields)


def _compare(path: str, a: _Leaf, b: _Leaf | None) -> PathDiff:
    if b is None:
        return _only(path, a, "only_a")
    (kind_a, dtype_a, x), (kind_b, dtype_b, y) = a, b
    both = kind_a == kind_b == "tensor"
    shape_a, shape_b = (tuple(x.shape), tuple(y.shape)) if both else (None, None)
    sides: dict[str, Any] = {"dtype_a": dtype_a, "dtype_b": dtype_b, "shape_a": shape_a, "shape_b": shape_b}
    if not both:
        sides.update(value_a=x if kind_a == "value" else None, value_b=y if kind_b == "value" else None)
    kind: Kind = "tensor" if both else "value"
    if (kind_a, dtype_a) != (kind_b, dtype_b):
        return PathDiff(path, "dtype_changed", kind, **sides)
    if shape_a != shape_b:
        return PathDiff(path, "shape_changed", kind, **sides)
    if not both:
        return _value_diff(path, x, y, sides)
    stats = _Stats()
    for cx, cy in _chunks(x, y):
        stats.add(cx, cy, _as_numbers(dtype_a, cx), _as_numbers(dtype_a, cy))
    return PathDiff(path, "identical" if stats.same else "differs", kind, **sides, **stats.numbers())


def _value_diff(path: str, x: Any, y: Any, sides: dict[str, Any]) -> PathDiff:
    """Two python values of one type: bit-identical (floats by their bits), or how far apart."""
    if x.hex() == y.hex() if isinstance(x, float) else x == y:
        return PathDiff(path, "identical", "value", **sides, changed=0)
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return PathDiff(path, "differs", "value", **sides, changed=1)
    floats = isinstance(x, float)
    finite = not floats or (math.isfinite(x) and math.isfinite(y))
    changed = x != y and not (floats and math.isnan(x) and math.isnan(y))  # -0.0 vs 0.0: bits only
    gap = _finite(_float(abs(x - y))) if finite else None
    return PathDiff(
        path,
        "differs",
        "value",
        **sides,
        changed=int(changed),
        nonfinite=int(changed and not finite),
        max_abs=gap,
        mean_abs=gap,
    )


def _float(x: int | float) -> float:
    try:
        return float(x)
    except OverflowError:  # an int beyond float64
        return math.inf


def _chunks(
    x: np.ndarray[Any, Any], y: np.ndarray[Any, Any]
) -> Iterator[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]:
    flat_x, flat_y = x.reshape(-1), y.reshape(-1)
    for start in range(0, max(flat_x.size, 1), _CHUNK):
        yield flat_x[start : start + _CHUNK], flat_y[start : start + _CHUNK]


def _as_numbers(dtype: str, chunk: np.ndarray[Any, Any]) -> np.ndarray[Any, Any] | None:
    """The values of a chunk as float64 (complex128 for complex; bfloat16 bits widened), or None
    for float8, which numpy cannot represent: its elements are compared by their bits only."""
    if dtype.startswith("float8"):
        return None
    if dtype == "bfloat16":
        return (chunk.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return chunk.astype(np.complex128 if chunk.dtype.kind == "c" else np.float64)


class _Stats:
    """Running counts and absolute differences over the chunks of two arrays (or two values)."""

    def __init__(self) -> None:
        self.same = True
        self.numeric = True
        self.changed = self.nonfinite = self.finite = 0
        self.total = self.worst = 0.0

    def add(
        self,
        x: np.ndarray[Any, Any],
        y: np.ndarray[Any, Any],
        nx: np.ndarray[Any, Any] | None,
        ny: np.ndarray[Any, Any] | None,
    ) -> None:
        """One chunk of each side, and its values as numbers (None: compare elements by bits)."""
        self.same = self.same and x.tobytes() == y.tobytes()
        if nx is None or ny is None:
            self.numeric = False
            self.changed += int(np.count_nonzero(x != y))
            return
        with np.errstate(invalid="ignore", over="ignore"):
            finite = np.isfinite(nx) & np.isfinite(ny)
            differ = ~((nx == ny) | (np.isnan(nx) & np.isnan(ny)))
            gaps = np.abs(nx[finite] - ny[finite])
        self.changed += int(np.count_nonzero(differ))
        self.nonfinite += int(np.count_nonzero(differ & ~finite))
        self.finite += int(gaps.size)
        self.total += float(gaps.sum())
        self.worst = max(self.worst, float(gaps.max(initial=0.0)))

    def numbers(self) -> dict[str, Any]:
        if not self.numeric:
            return {"changed": self.changed}
        mean = self.total / self.finite if self.finite else None
        return {
            "changed": self.changed,
            "nonfinite": self.nonfinite,
            "max_abs": _finite(self.worst) if self.finite else None,
            "mean_abs": None if mean is None else _finite(mean),
        }


def _finite(x: float) -> float | None:
    """JSON has no infinity: a difference too large for float64 is reported as unknown (None)."""
    return x if math.isfinite(x) else None
