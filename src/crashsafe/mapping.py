"""Zero-copy, read-only views of a local step's raw payloads: ``load(step, mmap=True)``.

For inspection and export: each raw payload comes back as a read-only numpy array over the data
file mapped into memory (its checksum verified over the mapping, so its pages are read once and
never copied; a reference maps the file of the step that holds its bytes); payloads of other
codecs are decoded as :func:`~crashsafe.loading.read_state` does. A mapped file stays readable
while any view of it lives, even after retention deletes its step (deleting unlinks, it never
truncates a committed file; a memory store writes over a deleted step's file only when nothing maps
it). Only a local directory can be mapped.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from crashsafe.chain import ChainReader
from crashsafe.codecs.raw import Raw
from crashsafe.codecs.registry import get_codec
from crashsafe.distributed.group import SOLO, Coordination
from crashsafe.distributed.trees import plain_tree
from crashsafe.errors import CodecError, CorruptCheckpointError, CrashsafeError
from crashsafe.format.dtypes import storage_dtype
from crashsafe.format.manifest import Manifest, PayloadEntry
from crashsafe.loading import array_ids, first_intact, holding, read_value, reading_error, state_of
from crashsafe.references import referred_damage
from crashsafe.state.rebuild import to_value
from crashsafe.storage.base import Store
from crashsafe.storage.layout import step_name
from crashsafe.storage.local import LocalStore

__all__ = ["map_state", "map_step"]


def map_step(
    stores: Sequence[Store], step: int | None, rank: int | None = None, coord: Coordination = SOLO
) -> tuple[int, dict[str, Any]] | None:
    """(step, :func:`map_state`) of ``step`` (in the first store that holds it), or of the newest
    step that maps intact, for every process of ``coord`` alike; None if there is no step at all."""
    if step is not None and len(stores) > 1:
        stores = [holding(stores, step)]
    return first_intact(stores, step, lambda store, at, last: map_state(store, at, rank), coord)


def map_state(store: Store, step: int, rank: int | None = None) -> dict[str, Any]:
    """The state ``rank`` saved as ``step`` (as :func:`~crashsafe.loading.read_state` picks its tree),
    its raw payloads as read-only numpy views of the mapped files."""
    if not isinstance(store, LocalStore):
        raise CrashsafeError(
            f"load(mmap=True) maps the files of a local checkpoint directory; {store.location} is not one. "
            "Load it without mmap=True, or copy the step to a local directory first"
        )
    try:
        with ChainReader(store) as chains:
            manifest = chains.manifest(step)  # validated; the data files have the sizes it says
            tree = plain_tree(manifest) if rank is None else manifest.tree_of(rank)
            maps: dict[tuple[int, str], mmap.mmap] = {}
            values: list[Any] = [None] * len(manifest.payloads)
            for i in sorted(array_ids(tree)):
                entry = manifest.payloads[i]
                if not _mappable(entry):
                    values[i] = read_value(chains, manifest, entry, True)
                    continue
                at, own = chains.owner(step, entry)  # a reference: mapped from the step holding it
                holder = chains.manifest(at)
                region = maps.get((at, own.file))
                if region is None:
                    region = maps[at, own.file] = _map(store, holder, own.file)
                try:
                    values[i] = to_value(entry.kind, entry.dtype, _view(region, own, holder), True)
                except CorruptCheckpointError as exc:
                    if at == step:
                        raise
                    where = f"checkpoint step {step}: payload '{entry.path}'"
                    raise referred_damage(where, at, exc) from None
    except OSError as exc:
        raise reading_error(exc, store, step) from None
    return state_of(tree, values, step)


def _mappable(entry: PayloadEntry) -> bool:
    try:
        codec = get_codec(entry.codec)
    except CodecError:
        return False  # read_value reports it as damage
    return isinstance(codec, Raw) and entry.nbytes == entry.raw_nbytes and entry.shard is None


def _map(store: LocalStore, manifest: Manifest, name: str) -> mmap.mmap:
    """A data file of the step mapped read-only (opened relative to the directory, no links)."""
    directory = store.root.subdir(step_name(manifest.step))
    try:
        fd = directory.open_file(name)
    finally:
        directory.close()
    try:
        if os.fstat(fd).st_size != manifest.files[name]:
            raise CorruptCheckpointError(f"checkpoint step {manifest.step}: {name} changed while it was read")
        if manifest.files[name] == 0:
            return mmap.mmap(-1, 1)  # nothing to map: an empty region for empty payloads
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)


def _view(region: mmap.mmap, entry: PayloadEntry, manifest: Manifest) -> np.ndarray[Any, Any]:
    """The payload's bytes in ``region`` as a read-only array, their checksum verified."""
    data = np.frombuffer(region, dtype=np.uint8, count=entry.nbytes, offset=entry.offset)
    if xxhash.xxh3_64_hexdigest(data.data) != entry.xxh3:
        raise CorruptCheckpointError(
            f"checkpoint step {manifest.step}: payload '{entry.path}' fails its checksum ({entry.file} bytes "
            f"{entry.offset}..{entry.offset + entry.nbytes} are damaged)"
        )
    dtype = storage_dtype(entry.dtype)
    view = np.frombuffer(region, dtype=dtype, count=math.prod(entry.shape), offset=entry.offset)
    return view.reshape(entry.shape)
