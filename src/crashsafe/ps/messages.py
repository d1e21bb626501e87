"""Plain-data messages between workers and servers (dicts of numpy arrays: no classes on the wire).

``Push``: ``{"w": worker, "t": clock, "rows": [rows per table], "grads": [grad rows per table]}``.
``Copy``: ``{"blocks", "ver", "v" (flat values), "s" (state, n_state x len(v)), "applied", "n"}``:
a block's value and optimizer state at a version, with, per worker, the last clock of that
worker's updates it includes (``applied``) and how many block updates it includes (``n``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["Copy", "Push", "empty_copy", "nbytes", "push_blocks"]

Push = dict[str, Any]
Copy = dict[str, Any]


def empty_copy(n_state: int, workers: int) -> Copy:
    """A copy holding no block."""
    return {
        "blocks": np.zeros(0, np.int64),
        "ver": np.zeros(0, np.int64),
        "v": np.zeros(0, np.float32),
        "s": np.zeros((n_state, 0), np.float32),
        "applied": np.zeros((0, workers), np.int64),
        "n": np.zeros(0, np.int64),
    }


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
