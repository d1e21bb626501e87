"""Plain-data messages between workers and servers (dicts of numpy arrays: no classes on the wire).

``Push``: ``{"w": worker, "t": clock, "rows": [rows per table], "grads": [grad rows per table]}``.
``Copy``: ``{"blocks", "v" (flat values), "s" (optimizer state, n_state x len(v); absent for SGD),
"meta"}``: blocks' values and optimizer state at a version. ``meta`` is one int32 array, a row per
block: version, number of block updates included, then the last clock of each worker's updates
included (under BSP one column: whole clocks are applied in order). One array, not four: every
array costs serialization time on each of the many small pulls. A pull's reply has the values
of every block asked for and, with FreeLauncher, ``meta`` and ``s`` of only the blocks listed in
``full`` (all of them when ``full`` is absent): the ones it makes the worker a complete copy of.

Replica copies travel from a server through the driver to a worker as one ``bytes`` each
(:func:`encode_copy`): Ray passes a bytes argument for a small fraction of what any numpy array
argument costs it (about 0.03 against 0.12-0.15 ms per call here), and a worker gets a few each clock.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "APPLIED",
    "COUNT",
    "VER",
    "Copy",
    "Push",
    "decode_copy",
    "encode_copy",
    "nbytes",
    "pack_meta",
    "push_blocks",
]

Push = dict[str, Any]
Copy = dict[str, Any]


VER, COUNT, APPLIED = 0, 1, 2  # columns of a copy's "meta"


def pack_meta(
    version: NDArray[np.int64], count: NDArray[np.int64], applied: NDArray[np.int64]
) -> NDArray[np.int32]:
    """The ``meta`` rows of a copy (``applied`` has one column per worker, or one under BSP)."""
    return np.column_stack([version, count, applied]).astype(np.int32)


def encode_copy(copy: Copy) -> bytes:
    """A copy as one ``bytes``: a header of four int64 (blocks, values, meta columns, state
    rows), then ``blocks`` (int64), ``meta`` (int32), ``v`` and ``s`` (float32), raw."""
    meta, v = copy["meta"], copy["v"]
    s = copy.get("s", np.zeros((0, v.size), np.float32))
    header = np.array([len(copy["blocks"]), v.size, meta.shape[1], s.shape[0]], np.int64)
    parts = (header, copy["blocks"].astype(np.int64), meta.astype(np.int32), v, s.astype(np.float32))
    return b"".join(np.ascontiguousarray(a).tobytes() for a in parts)


def decode_copy(data: bytes) -> Copy:
    """Inverse of :func:`encode_copy` (read-only arrays viewing ``data``)."""
    n, size, cols, rows = (int(x) for x in np.frombuffer(data, np.int64, 4))
    at = 32
    blocks = np.frombuffer(data, np.int64, n, at)
    at += 8 * n
    meta = np.frombuffer(data, np.int32, n * cols, at).reshape(n, cols)
    at += 4 * n * cols
    copy: Copy = {"blocks": blocks, "v": np.frombuffer(data, np.float32, size, at), "meta": meta}
    if rows:
        copy["s"] = np.frombuffer(data, np.float32, rows * size, at + 4 * size).reshape(rows, size)
    return copy


def nbytes(message: Any) -> int:
    """Payload bytes of the numpy arrays and bytes in a message (nested dicts and lists)."""
    if isinstance(message, np.ndarray):
        return int(message.nbytes)
    if isinstance(message, bytes):
        return len(message)
    if isinstance(message, dict):
        return sum(nbytes(v) for v in message.values())
    if isinstance(message, (list, tuple)):
        return sum(nbytes(v) for v in message)
    return 0


def push_blocks(push: Push, blocks_of_rows: Any) -> NDArray[np.int64]:
    """Sorted global blocks a push touches; ``blocks_of_rows(table, rows)`` maps rows to blocks."""
    parts = [blocks_of_rows(ti, r) for ti, r in enumerate(push["rows"]) if r.size]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
