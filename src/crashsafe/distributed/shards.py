"""Shards as boxes in their global tensor: assemble a whole tensor, or cut any other box out.

A DTensor's local shard is saved with its global shape and offset, so a checkpoint saved by N ranks
can be read back in any layout: a whole tensor (one process, ``load``, export), or the local box of
another mesh and placement (M ranks). Saved shards must tile their global tensor exactly; a reader
that finds a gap or an overlap reports the step damaged. Of a saved shard with chunk checksums (raw,
format version 3) a reader that needs only a part reads and verifies only the chunks holding it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from crashsafe.chain import ChainReader
from crashsafe.errors import CorruptCheckpointError
from crashsafe.format.dtypes import storage_dtype
from crashsafe.format.manifest import Manifest, PayloadEntry
from crashsafe.state.inplace import Box, Destination
from crashsafe.state.rebuild import to_value
from crashsafe.state.tree import Shard

__all__ = [
    "Box", "Targets", "box_jobs", "check_shards", "check_tiling", "fill_from", "flat_span", "live_targets",
    "read_range", "read_sharded",
]  # fmt: skip


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


def check_tiling(
    global_shape: tuple[int, ...], boxes: Sequence[Box], what: str, within: Box | None = None
) -> None:
    """Raise CorruptCheckpointError unless ``boxes`` cover ``global_shape`` exactly once; for a
    partial step (one rank's part: :attr:`Manifest.partial`), unless they do not overlap and cover
    the box ``within`` that is read exactly once (no box: nothing is read, only overlaps count)."""
    overlapping = any(
        _overlap(a, b) is not None and math.prod(a[1]) and math.prod(b[1])
        for i, a in enumerate(boxes)
        for b in boxes[i + 1 :]
    )
    if within is None:
        volume, wanted = sum(math.prod(shape) for _, shape in boxes), math.prod(global_shape)
    else:
        meets = [both for box in boxes if (both := _overlap(within, box)) is not None]
        volume = sum(math.prod(s.stop - s.start for s in region) for region, _ in meets)
        wanted = math.prod(within[1])
    if volume != wanted or overlapping:
        where = "its global shape" if within is None else "the part of its global shape"
        raise CorruptCheckpointError(
            f"{what}: its shards do not tile {where} {global_shape if within is None else within} (a shard "
            "is missing, doubled or damaged)"
        )


def check_shards(manifest: Manifest) -> None:
    """Raise CorruptCheckpointError unless the saved shards of every sharded array of ``manifest``
    agree on its type and tile its global shape exactly: what every read of the array checks before
    it reads a byte of it (:func:`read_sharded`, :func:`box_jobs`), for ``verify`` to check too."""
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for entry in manifest.payloads:
        if entry.shard is None or (entry.path, entry.shard[0]) in seen:
            continue
        seen.add((entry.path, entry.shard[0]))
        _, boxes = _parts_of(manifest, entry)
        whole = entry.shard[0]
        within = ((0,) * len(whole), (0,) * len(whole)) if manifest.partial else None  # overlaps only
        check_tiling(whole, boxes, f"checkpoint step {manifest.step}: array '{entry.path}'", within)


def box_jobs(
    manifest: Manifest, entry: PayloadEntry, into: Destination
) -> list[tuple[PayloadEntry, Destination]]:
    """The saved shards of ``entry``'s array that meet ``into.box`` (the live tensor's part of the
    global one), each with where it goes: a shard that lies inside the box straight into its part of
    ``into.out`` when that part is contiguous memory (the same shard, or N ranks restored by fewer),
    any other into ``into`` by :func:`fill_from`. Raises CorruptCheckpointError, before anything is
    read, if the shards do not tile the array."""
    assert into.box is not None
    parts, boxes = _parts_of(manifest, entry)
    whole = entry.shape if entry.shard is None else entry.shard[0]
    within = into.box if manifest.partial else None
    check_tiling(whole, boxes, f"checkpoint step {manifest.step}: array '{entry.path}'", within)
    jobs = []
    for part, box in zip(parts, boxes, strict=True):
        both = _overlap(into.box, box) if math.prod(box[1]) else None
        if both is None:
            continue
        region = into.out[both[0]]
        inside = region.shape == box[1] and region.flags.c_contiguous
        jobs.append((part, Destination(into.value, region) if inside else into))
    return jobs


def fill_from(
    chains: ChainReader, step: int, part: PayloadEntry, into: Destination, *, verify_only: bool = False
) -> None:
    """Copy the part of one saved shard inside ``into.box`` into ``into.out``: a shard that only
    overlaps the box (N ranks restored by more). See :func:`_cut` for what is read; with
    ``verify_only`` the same bytes are verified and nothing is copied."""
    assert into.box is not None
    both = _overlap(into.box, _box_of(part))
    if both is not None:
        region = _cut(chains, step, part, both[1], verify_only)
        if region is not None:
            into.out[both[0]] = region


def read_range(part: PayloadEntry, into: Destination) -> tuple[int, int]:
    """The bytes ``[start, stop)`` of saved shard ``part``'s payload that :func:`fill_from` needs
    for ``into`` (it reads them rounded out to whole chunks), or all of them where it decodes the
    shard whole: where reading starts, and about how much it reads."""
    assert into.box is not None
    both = _overlap(into.box, _box_of(part))
    if both is None:
        return 0, 0
    span = _elements(part, both[1])
    if span is None:
        return 0, part.nbytes
    itemsize = storage_dtype(part.dtype).itemsize
    return span[0] * itemsize, span[1] * itemsize


def read_sharded(
    chains: ChainReader, manifest: Manifest, entry: PayloadEntry, target: Shard | None, numpy: bool
) -> Any:
    """The array a payload is part of: every rank's shards of it assembled whole, or cut to
    ``target`` (a live DTensor's box, returned as a DTensor), reading only the shards it meets, and
    of a shard with chunk checksums only the chunks that hold its part (:func:`_cut`). A payload
    saved whole is cut the same way when a live DTensor wants a box of it."""
    parts, boxes = _parts_of(manifest, entry)
    whole = entry.shape if entry.shard is None else entry.shard[0]
    cut = target is not None and target.global_shape == whole
    box: Box = (
        (target.offset, _box_shape(target)) if cut and target is not None else ((0,) * len(whole), whole)
    )
    within = box if manifest.partial else None  # (a part read whole must hold all of it)
    check_tiling(whole, boxes, f"checkpoint step {manifest.step}: array '{entry.path}'", within)
    out = np.empty(box[1], dtype=storage_dtype(entry.dtype))
    for part, part_box in zip(parts, boxes, strict=True):
        both = _overlap(box, part_box) if math.prod(part_box[1]) else None
        if both is not None:
            out[both[0]] = _cut(chains, manifest.step, part, both[1], False)
    value = to_value(entry.kind, entry.dtype, out, numpy)
    if cut and target is not None and not numpy:
        return _as_dtensor(value, target)
    return value


def _cut(
    chains: ChainReader, step: int, part: PayloadEntry, where: tuple[slice, ...], verify_only: bool
) -> np.ndarray[Any, Any] | None:
    """The region ``where`` of saved shard ``part``, verified. A shard with chunk checksums is read
    only over the chunks holding the contiguous run of its bytes from the region's first element to
    its last (a rank's part of a shard of N ranks restored by more); any other shard, or a region
    that is all of it, is decoded whole, so that every byte is verified against its checksum."""
    span = _elements(part, where)
    if span is None:
        if verify_only:
            chains.check(step, part)
            return None
        return cast("np.ndarray[Any, Any]", chains.decode(step, part)).reshape(part.shape)[where]
    flat = chains.span(step, part, span[0], span[1] - span[0], verify_only=verify_only)
    if flat is None:
        return None
    strides = tuple(math.prod(part.shape[i + 1 :]) * flat.itemsize for i in range(len(part.shape)))
    shape = tuple(s.stop - s.start for s in where)
    return np.ndarray(shape, flat.dtype, buffer=flat, strides=strides)  # bounds checked by numpy


def _elements(part: PayloadEntry, where: tuple[slice, ...]) -> tuple[int, int] | None:
    """The flat elements of ``part`` that :func:`_cut` reads for region ``where``, or None if it
    decodes the shard whole (it has no chunk checksums, or the region is all of it)."""
    whole = all(s.start == 0 and s.stop == n for s, n in zip(where, part.shape, strict=True))
    if part.chunks is None or whole:
        return None
    return flat_span(part.shape, where)


def flat_span(shape: tuple[int, ...], where: tuple[slice, ...]) -> tuple[int, int]:
    """The flat (C order) indices ``[first, stop)`` from the first element of the non-empty region
    ``where`` (slices with steps of 1) of an array of ``shape`` to its last."""
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    first = sum(s.start * k for s, k in zip(where, strides, strict=True))
    last = sum((s.stop - 1) * k for s, k in zip(where, strides, strict=True))
    return first, last + 1


def _box_of(part: PayloadEntry) -> Box:
    """Where a saved payload lies in its global tensor (all of it, if it was saved whole)."""
    return ((0,) * len(part.shape), part.shape) if part.shard is None else (part.shard[1], part.shape)


def _parts_of(manifest: Manifest, entry: PayloadEntry) -> tuple[list[PayloadEntry], list[Box]]:
    """The payloads holding the array ``entry`` is part of, and their boxes in it."""
    if entry.shard is None:  # saved whole (one process, or replicated): one box holds it all
        return [entry], [((0,) * len(entry.shape), entry.shape)]
    whole = entry.shard[0]
    parts = [
        p for p in manifest.payloads if p.path == entry.path and p.shard is not None and p.shard[0] == whole
    ]
    if any((p.kind, p.dtype) != (entry.kind, entry.dtype) for p in parts):
        raise CorruptCheckpointError(
            f"checkpoint step {manifest.step}: the shards of array '{entry.path}' disagree on its type "
            "(a damaged or forged manifest). Run `crashsafe verify`"
        )
    return parts, [(p.shard[1], p.shape) for p in parts if p.shard is not None]


def _box_shape(target: Shard) -> tuple[int, ...]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, _ = compute_local_shape_and_global_offset(target.global_shape, target.mesh, target.placements)
    return tuple(shape)


def _as_dtensor(local: Any, target: Shard) -> Any:
    """The local box as a DTensor of the live tensor's mesh and placements."""
    import torch
    from torch.distributed.tensor import DTensor

    whole = target.global_shape
    stride = tuple(math.prod(whole[i + 1 :]) for i in range(len(whole)))
    return DTensor.from_local(
        local, target.mesh, target.placements, run_check=False, shape=torch.Size(whole), stride=stride
    )


class Targets:
    """Where the live state wants each sharded array: the boxes of its DTensors, by path.

    An optimizer's state follows its parameters' sharding but does not exist before its first step,
    so a fresh optimizer's state is placed like the parameter it belongs to
    (``<optimizer path>.state.<i>.*`` like parameter ``i``).
    """

    def __init__(self, exact: dict[str, Shard], by_prefix: dict[str, Shard]) -> None:
        self.exact = exact
        self.by_prefix = by_prefix

    def get(self, path: str) -> Shard | None:
        found = self.exact.get(path)
        if found is None:
            prefix, _, _ = path.rpartition(".")
            found = self.by_prefix.get(prefix + ".")
        return found


def live_targets(state: Any, leaves: Sequence[Any]) -> Targets:
    """The targets of a live state: its DTensor leaves, and its optimizers' parameters."""
    exact = {leaf.path: leaf.shard for leaf in leaves if leaf.shard is not None}
    by_prefix: dict[str, Shard] = {}
    for path, optimizer in _optimizers(state, ()):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for i, param in enumerate(params):
            shard = _shard_of(param)
            if shard is not None:
                by_prefix[".".join(map(str, (*path, "state", i))) + "."] = shard
    return Targets(exact, by_prefix)


def _optimizers(value: Any, path: tuple[Any, ...], depth: int = 0) -> list[tuple[tuple[Any, ...], Any]]:
    import torch

    if isinstance(value, torch.optim.Optimizer):
        return [(path, value)]
    if depth > 64:
        return []
    if isinstance(value, dict):
        return [found for k, v in value.items() for found in _optimizers(v, (*path, k), depth + 1)]
    if isinstance(value, (list, tuple)):
        return [found for i, v in enumerate(value) for found in _optimizers(v, (*path, i), depth + 1)]
    return []


def _shard_of(tensor: Any) -> Shard | None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return None
    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return Shard(tuple(tensor.shape), tuple(int(o) for o in offset), tensor.device_mesh, tensor.placements)
