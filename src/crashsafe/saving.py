"""One step of one process: every array encoded by the planner, written, then committed.

The store's draft moves the bytes and runs its commit protocol; the planner picks codecs and delta
bases and keeps its chains only once the step is committed. The distributed counterpart, where
every rank writes its part and rank 0 commits, is :mod:`crashsafe.distributed.saving`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from crashsafe.encoding import SavePlanner
from crashsafe.format.manifest import Manifest, PayloadEntry
from crashsafe.state.tree import ArrayLeaf
from crashsafe.storage.base import Store
from crashsafe.storage.writer import StepWriter

__all__ = ["SaveStats", "save_step"]


@dataclass(frozen=True)
class SaveStats:
    """Measured cost of one committed save (seconds and bytes)."""

    step: int
    stall: float
    persist: float
    raw_bytes: int
    stored_bytes: int


def save_step(
    store: Store,
    planner: SavePlanner,
    step: int,
    committed: frozenset[int],
    tree: dict[str, Any],
    leaves: list[ArrayLeaf],
    arrays: list[np.ndarray[Any, Any]],
    metrics: dict[str, Any],
    info: dict[str, Any],
) -> Manifest:
    """Write and commit ``step``; ``committed`` are the steps committed before it (delta bases)."""
    writer = StepWriter(store, step)
    try:
        entries = []
        for leaf, array in zip(leaves, arrays, strict=True):
            encoded = planner.encode(leaf, array, step, committed)
            file, offset, nbytes, digest = writer.write_payload(encoded.payload)
            config = encoded.codec.get_config()
            entries.append(
                PayloadEntry(
                    leaf.path,
                    leaf.kind,
                    leaf.dtype,
                    leaf.shape,
                    file,
                    offset,
                    nbytes,
                    digest,
                    config,
                    encoded.base,
                )
            )
        manifest = Manifest(step, time.time(), tree, tuple(entries), writer.files(), metrics, info)
        writer.commit(manifest)
    except BaseException:
        writer.abort()
        planner.reset()  # references were advanced in place for a step that never committed
        raise
    planner.committed()
    return manifest
