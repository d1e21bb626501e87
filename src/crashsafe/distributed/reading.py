"""Read a step back for one rank, in any layout: resharding a checkpoint of N ranks onto M.

A rank reads the tree it saved (a rank the step did not have reads rank 0's), decoding only the
payloads that tree uses. A sharded array (a DTensor's shard) is assembled from every rank's shards:
cut to the box of the live DTensor it is restored into (decoding only the shards that overlap it),
or whole (``load()``, one process, export). Works for single-process steps too (no shards).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from crashsafe.chain import ChainReader
from crashsafe.distributed.shards import Box, check_tiling, fill
from crashsafe.errors import CorruptCheckpointError
from crashsafe.format.dtypes import storage_dtype
from crashsafe.format.manifest import Manifest, PayloadEntry
from crashsafe.state.rebuild import to_value, unflatten
from crashsafe.state.tree import Shard
from crashsafe.storage.base import Store

__all__ = ["read_for_rank"]


def read_for_rank(
    store: Store, step: int, rank: int, numpy: bool, targets: dict[str, Shard] | None = None
) -> dict[str, Any]:
    """The state ``rank`` saved at ``step``; sharded arrays are cut to ``targets[path]`` (the live
    DTensors' boxes, returned as DTensors) or else assembled whole."""
    with ChainReader(store) as chains:
        manifest = chains.manifest(step)
        tree = manifest.tree_of(rank)
        values: list[Any] = [None] * len(manifest.payloads)  # a tree asks only for the arrays it uses
        for i in sorted(_ids(tree)):
            entry = manifest.payloads[i]
            if entry.shard is None:
                values[i] = to_value(entry.kind, entry.dtype, chains.decode(step, entry), numpy)
            else:
                values[i] = _sharded(chains, manifest, entry, (targets or {}).get(entry.path), numpy)
    state = unflatten(tree, values)
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"step {step}: the saved state is not a dict")
    return state


def _ids(node: Any) -> set[int]:
    """Payload indices an (already validated) tree uses."""
    if isinstance(node, dict):
        if node.get("t") == "array":
            return {node["id"]}
        return set().union(*(_ids(v) for v in node.values())) if node else set()
    if isinstance(node, list):
        return set().union(*(_ids(v) for v in node)) if node else set()
    return set()


def _sharded(
    chains: ChainReader, manifest: Manifest, entry: PayloadEntry, target: Shard | None, numpy: bool
) -> Any:
    assert entry.shard is not None
    whole, _ = entry.shard
    parts = [
        p for p in manifest.payloads if p.path == entry.path and p.shard is not None and p.shard[0] == whole
    ]
    boxes: list[Box] = [(p.shard[1], p.shape) for p in parts if p.shard is not None]
    check_tiling(whole, boxes, f"checkpoint step {manifest.step}: array '{entry.path}'")
    cut = target is not None and target.global_shape == whole
    box: Box = (
        (target.offset, _box_shape(target)) if cut and target is not None else ((0,) * len(whole), whole)
    )
    out = np.empty(box[1], dtype=storage_dtype(entry.dtype))
    pieces = []
    for part, part_box in zip(parts, boxes, strict=True):
        if _meets(box, part_box):
            pieces.append((part_box, chains.decode(manifest.step, part)))
    fill(out, box, pieces)
    value = to_value(entry.kind, entry.dtype, out, numpy)
    if cut and target is not None and not numpy:
        return _as_dtensor(value, target)
    return value


def _box_shape(target: Shard) -> tuple[int, ...]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, _ = compute_local_shape_and_global_offset(target.global_shape, target.mesh, target.placements)
    return tuple(shape)


def _meets(a: Box, b: Box) -> bool:
    return (
        all(
            max(ao, bo) < min(ao + an, bo + bn) for ao, an, bo, bn in zip(a[0], a[1], b[0], b[1], strict=True)
        )
        and math.prod(b[1]) > 0
    )


def _as_dtensor(local: Any, target: Shard) -> Any:
    """The local box as a DTensor of the live tensor's mesh and placements."""
    import torch
    from torch.distributed.tensor import DTensor

    whole = target.global_shape
    stride = tuple(math.prod(whole[i + 1 :]) for i in range(len(whole)))
    return DTensor.from_local(
        local, target.mesh, target.placements, run_check=False, shape=torch.Size(whole), stride=stride
    )
