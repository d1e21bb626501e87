"""Shards as boxes in their global tensor: assemble a whole tensor, or cut any other box out.

A DTensor's local shard is saved with its global shape and offset, so a checkpoint saved by N ranks
can be read back in any layout: a whole tensor (one process, ``load``, export), or the local box of
another mesh and placement (M ranks). Saved shards must tile their global tensor exactly; a reader
that finds a gap or an overlap reports the step damaged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from crashsafe.errors import CorruptCheckpointError

__all__ = ["Box", "check_tiling", "fill"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape)


def _overlap(a: Box, b: Box) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Slices of the overlap of boxes ``a`` and ``b``, relative to each (None if they do not meet)."""
    in_a, in_b = [], []
    for (ao, an), (bo, bn) in zip(zip(a[0], a[1], strict=True), zip(b[0], b[1], strict=True), strict=True):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if lo >= hi:
            return None
        in_a.append(slice(lo - ao, hi - ao))
        in_b.append(slice(lo - bo, hi - bo))
    return tuple(in_a), tuple(in_b)


def check_tiling(global_shape: tuple[int, ...], boxes: Sequence[Box], what: str) -> None:
    """Raise CorruptCheckpointError unless ``boxes`` cover ``global_shape`` exactly once."""
    volume = sum(math.prod(shape) for _, shape in boxes)
    overlapping = any(
        _overlap(a, b) is not None and math.prod(a[1]) and math.prod(b[1])
        for i, a in enumerate(boxes)
        for b in boxes[i + 1 :]
    )
    if volume != math.prod(global_shape) or overlapping:
        raise CorruptCheckpointError(
            f"{what}: its shards do not tile its global shape {global_shape} (a shard is missing, "
            "doubled or damaged)"
        )


def fill(out: np.ndarray[Any, Any], out_box: Box, pieces: Sequence[tuple[Box, np.ndarray[Any, Any]]]) -> None:
    """Copy into ``out`` (the box ``out_box`` of the global tensor) every part of ``pieces`` that
    falls inside it; each piece is (its box, its array)."""
    for box, array in pieces:
        both = _overlap(out_box, box)
        if both is not None:
            out[both[0]] = array.reshape(box[1])[both[1]]
