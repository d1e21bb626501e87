"""Plain-data messages between workers and servers (dicts of numpy arrays: no classes on the wire).

``Push``: ``{"w": worker, "t": clock, "rows": [rows per table], "grads": [grad rows per table]}``.
``Copy``: ``{"blocks", "v" (flat values), "s" (optimizer state, n_state x len(v); absent for SGD),
"meta"}``: blocks' values and optimizer state at a version. ``meta`` is one int32 array, a row per
block: version, number of block updates included, then the last clock of each worker's updates
included (under BSP one column: whole clocks are applied in order). One array, not four: every
array costs serialization time on each of the many small pulls. A pull's reply has the values
of every block asked for and, with FreeLauncher, ``meta`` and ``s`` of only the blocks listed in
``full`` (all of them when ``full`` is absent): the ones it makes the worker a complete copy of.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["APPLIED", "COUNT", "VER", "Copy", "Push", "nbytes", "pack_meta", "push_blocks"]

Push = dict[str, Any]
Copy = dict[str, Any]


VER, COUNT, APPLIED = 0, 1, 2  # columns of a copy's "meta"


def pack_meta(
    version: NDArray[np.int64], count: NDArray[np.int64], applied: NDArray[np.int64]
) -> NDArray[np.int32]:
    """The ``meta`` rows of a copy (``applied`` has one column per worker, or one under BSP)."""
    return np.column_stack([version, count, applied]).astype(np.int32)


def nbytes(message: Any) -> int:
    """Payload bytes of the numpy arrays in a message (nested dicts and lists)."""
    if isinstance(message, np.ndarray):
        return int(message.nbytes)
    if isinstance(message, dict):
        return sum(nbytes(v) for v in message.values())
    if isinstance(message, (list, tuple)):
        return sum(nbytes(v) for v in message)
    return 0


def push_blocks(push: Push, blocks_of_rows: Any) -> NDArray[np.int64]:
    """Sorted global blocks a push touches; ``blocks_of_rows(table, rows)`` maps rows to blocks."""
    parts = [blocks_of_rows(ti, r) for ti, r in enumerate(push["rows"]) if r.size]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
