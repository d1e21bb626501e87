"""Read a state back from a store: one step, or the newest intact one with fallback.

A damaged step (any :class:`CorruptCheckpointError` or :class:`StorageError` while reading it) is
skipped with a :class:`CorruptCheckpointWarning` naming the damage. A step that a writer deletes
while it is read is not damage: when every step tried vanished, the steps are listed afresh, so a
reader beside a writer always ends on a whole step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from crashsafe._cuda import DeviceUpload, is_cuda
from crashsafe._log import logger, warn
from crashsafe.chain import ChainReader
from crashsafe.distributed.shards import Targets, read_sharded
from crashsafe.distributed.trees import plain_tree
from crashsafe.errors import (
    CorruptCheckpointError,
    CorruptCheckpointWarning,
    CrashsafeError,
    InvalidArgumentError,
    MirrorWarning,
    NoCheckpointError,
    StorageError,
)
from crashsafe.format.manifest import Manifest, PayloadEntry
from crashsafe.state.rebuild import to_value, unflatten
from crashsafe.storage.base import Store
from crashsafe.storage.oserror import storage_error

__all__ = [
    "ARRAY_NODES",
    "READ_ATTEMPTS",
    "array_ids",
    "check_device",
    "from_copies",
    "holding",
    "listed_steps",
    "newest",
    "newest_intact",
    "note_read",
    "on_damage",
    "read_state",
    "read_value",
    "reading_error",
    "skip_damaged",
    "state_of",
]

_T = TypeVar("_T")

READ_ATTEMPTS = 5  # listings tried when every step tried vanished
ARRAY_NODES = ("array", "view")  # tree nodes that point at a payload by its index


def read_state(
    store: Store,
    step: int,
    numpy: bool,
    rank: int | None = None,
    targets: Targets | None = None,
    device: Any = None,
) -> dict[str, Any]:
    """The state ``rank`` saved as ``step`` (rank 0's for a rank the step did not have, or for a
    plain process, ``None``: warned about when the ranks saved different states): tensors (or
    numpy arrays), arrays and python values, verified; only the payloads its tree uses are read.
    A DTensor's shards are assembled whole, or cut to ``targets[path]`` (the box of the live DTensor
    it is restored into, any N ranks onto any M). With ``device`` tensors are made there (a CUDA
    device: read through pinned bounce buffers straight into device memory)."""
    try:
        with ChainReader(store) as chains:
            manifest = chains.manifest(step)
            tree = plain_tree(manifest) if rank is None else manifest.tree_of(rank)
            values: list[Any] = [None] * len(manifest.payloads)  # a tree asks only for the arrays it uses
            for i in sorted(array_ids(tree)):
                entry = manifest.payloads[i]
                values[i] = read_value(chains, manifest, entry, numpy, targets, device)
    except OSError as exc:
        raise reading_error(exc, store, step) from None
    return state_of(tree, values, step)


def read_value(
    chains: ChainReader,
    manifest: Manifest,
    entry: PayloadEntry,
    numpy: bool,
    targets: Targets | None = None,
    device: Any = None,
) -> Any:
    """One payload of a step as the value it was saved as, verified (a shard: see :func:`read_state`),
    a tensor on ``device`` if one is given."""
    target = None if targets is None else targets.get(entry.path)
    onto = device is not None and entry.kind == "torch" and not numpy
    if entry.shard is None and target is None:
        if onto:
            return _on_device(chains, manifest.step, entry, device)
        return to_value(entry.kind, entry.dtype, chains.decode(manifest.step, entry), numpy)
    value = read_sharded(chains, manifest, entry, target, numpy)
    return value.to(device) if onto else value


def check_device(device: Any, numpy: bool, mmap: bool) -> None:
    """Refuse ``device=`` beside ``numpy=True`` or ``mmap=True``, which give host arrays."""
    if device is not None and (numpy or mmap):
        raise InvalidArgumentError(
            f"load(device={device!r}) makes torch tensors on that device; numpy=True and mmap=True give "
            "host arrays. Drop device=, or the other option"
        )


def _on_device(chains: ChainReader, step: int, entry: PayloadEntry, device: Any) -> Any:
    """A payload as a new tensor on ``device``: a CUDA device's memory is filled through pinned
    bounce buffers (raw payloads; others are decoded on the host, then copied once)."""
    import torch

    from crashsafe.format.dtypes import torch_dtype

    tensor = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype), device=device)
    if not is_cuda(tensor):
        return to_value(entry.kind, entry.dtype, chains.decode(step, entry)).to(tensor.device)
    if not tensor.numel():
        chains.decode(step, entry)  # no bytes to place, but its stored bytes are verified all the same
        return tensor
    upload = DeviceUpload(tensor.view(-1).view(torch.uint8))
    try:
        chains.decode(step, entry, upload=upload)
    finally:
        upload.finish()  # nothing lands in that memory later, even after damage
    return tensor


def state_of(tree: dict[str, Any], values: Sequence[Any], step: int) -> dict[str, Any]:
    """The state a step's tree describes, its arrays filled in from ``values``."""
    state = unflatten(tree, values)
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"step {step}: the saved state is not a dict")
    return state


def reading_error(exc: OSError, store: Store, step: int) -> CrashsafeError:
    """An OSError while reading a step, as a crashsafe error (it is already one if it is)."""
    if isinstance(exc, CrashsafeError):
        return exc
    return storage_error(exc, f"reading step {step} from {store.location}")


def holding(stores: Sequence[Store], step: int) -> Store:
    """The first store (local tier first) that holds ``step``; the first one if none does."""
    return next((store for store in stores if step in store.steps()), stores[0])


_skipped = 0  # damaged steps skipped by reads in this process, for writers' delta chains


def skip_damaged(message: str) -> None:
    """Warn that a read skipped a damaged step (a CorruptCheckpointWarning), and count it: a writer
    whose delta chains may run through that step then starts new ones (:func:`on_damage`)."""
    global _skipped
    _skipped += 1
    warn(message, CorruptCheckpointWarning)


@contextlib.contextmanager
def on_damage(reset: Callable[[], None]) -> Iterator[None]:
    """Call ``reset`` if the reads inside find a damaged step, raised or skipped (counted by
    :func:`skip_damaged`): a writer then starts new delta chains, never one through the damage."""
    skipped = _skipped
    try:
        yield
    except CorruptCheckpointError:
        reset()
        raise
    if _skipped != skipped:
        reset()


def from_copies(stores: Sequence[Store], step: int, read: Callable[[Store], _T]) -> _T:
    """``read(store)`` of the first copy of ``step`` (local tier first) that reads intact: a damaged
    copy falls back to the next tier's copy of the same step, with a warning. With no tier holding
    it, the first store's error says the step is not committed."""
    if len(stores) == 1:  # one tier: no listing needed (a request, on an object store)
        return read(stores[0])
    copies = [store for store in stores if step in store.steps()] or [stores[0]]
    for store in copies[:-1]:
        try:
            return read(store)
        except (CorruptCheckpointError, StorageError) as exc:
            message = f"skipping a damaged copy: {exc}. Reading step {step} from the next tier."
            skip_damaged(message)
            logger().warning("fell back from the copy of step %d in %s because %s", step, store.location, exc)
    return read(copies[-1])


def array_ids(node: Any) -> set[int]:
    """The payloads an (already validated) state tree uses: its array and view nodes."""
    if isinstance(node, dict):
        if node.get("t") in ARRAY_NODES:
            return {node["id"]}
        found: set[int] = set()
        for value in node.values():
            found |= array_ids(value)
        return found
    if isinstance(node, list):
        found = set()
        for value in node:
            found |= array_ids(value)
        return found
    return set()


def listed_steps(stores: Sequence[Store]) -> list[list[int]]:
    """Each store's committed steps. The first store is the primary tier and its errors count; a
    mirror that cannot be listed (an outage) is read as empty, with a warning."""
    listed = [stores[0].steps()] if stores else []
    for store in stores[1:]:
        try:
            listed.append(store.steps())
        except StorageError as exc:
            warn(
                f"the mirror {store.location} cannot be listed now ({exc}); reading the local tier only",
                MirrorWarning,
            )
            listed.append([])
    return listed


def newest_intact(
    stores: Sequence[Store], numpy: bool, device: Any = None
) -> tuple[int, dict[str, Any]] | None:
    """(step, state) of the newest step that reads back intact from any of ``stores`` (tried in
    order for one step: a local copy before its mirror), or None if there is no step at all."""
    read = lambda store, step, last: read_state(store, step, numpy, device=device)  # noqa: E731
    return newest(stores, read)


def newest(
    stores: Sequence[Store], read: Callable[[Store, int, bool], _T]
) -> tuple[int, _T] | None:
    """(step, ``read(store, step, last)``) of the newest step ``read`` finds intact in any of
    ``stores``, damaged ones skipped with a warning; ``last`` tells ``read`` that no other step is
    left to fall back to if this one is damaged. None if there is no step at all."""
    damage: dict[tuple[int, int], str] = {}
    for _ in range(READ_ATTEMPTS):
        listed = listed_steps(stores)
        candidates = sorted(((step, -i) for i, steps in enumerate(listed) for step in steps), reverse=True)
        if not candidates:
            return None
        gone: set[tuple[int, int]] = set()  # deleted while read: no more a fallback than a damaged step
        for n, (step, tier) in enumerate(candidates):
            if (step, tier) in damage:
                continue
            try:
                last = all(other in damage or other in gone for other in candidates[n + 1 :])
                return step, read(stores[-tier], step, last)
            except (CorruptCheckpointError, StorageError) as exc:
                damage[step, tier] = str(exc)
                message = f"skipping damaged checkpoint: {exc}. Falling back to an older step."
                skip_damaged(message)
                logger().warning("fell back from step %d because %s", step, exc)
            except NoCheckpointError:
                gone.add((step, tier))  # deleted by the writer's retention while we read it
        if not gone:
            break
    where = " and ".join(store.location for store in stores)
    if gone:
        damaged = "; ".join(damage[k] for k in sorted(damage, reverse=True))
        raise NoCheckpointError(
            f"every step of {where} was deleted while it was read, {READ_ATTEMPTS} times over"
            + (f" (the others are damaged: {damaged})" if damage else "")
            + "; another process is deleting steps faster than this one reads them. Try again"
        )
    raise CorruptCheckpointError(
        f"every checkpoint in {where} is damaged: "
        + "; ".join(damage[k] for k in sorted(damage, reverse=True))
        + ". Run `crashsafe verify` for details."
    )


def note_read(step: int | None, asked: int | None, where: str, began: float) -> int | None:
    """Log the one line of a read: "resumed from step N" for the newest intact step (``asked`` None),
    "loaded step N" for a step asked for by number; where from and how long it took
    (``time.perf_counter()`` at ``began``). Returns ``step``."""
    if step is not None:
        what = "resumed from" if asked is None else "loaded"
        logger().info("%s step %d (%s, %.2f s)", what, step, where, time.perf_counter() - began)
    return step
