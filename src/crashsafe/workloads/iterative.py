"""What the checkpointed workloads share: an iterative algorithm whose whole state between
iterations is a flat dict, and where the arrays of its next state come from."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

__all__ = ["Algorithm", "Allocate", "numpy_arrays"]

_Array = np.ndarray[Any, Any]
Allocate = Callable[[str, tuple[int, ...]], _Array]
"""``(state name, shape) -> float64 array to fill``: numpy's, or a shelf's ``empty`` (in place)."""


def numpy_arrays(name: str, shape: tuple[int, ...]) -> _Array:
    """The default :data:`Allocate`: a new numpy array."""
    return np.empty(shape)


class Algorithm(Protocol):
    """``init_state`` then ``step`` after ``step``; each returns the complete next state."""

    name: str

    def init_state(self, x: _Array) -> dict[str, Any]: ...

    def step(self, x: _Array, state: dict[str, Any], out: Allocate | None = None) -> dict[str, Any]: ...
