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
from contextvars import ContextVar
from typing import Any, TypeVar, cast

from crashsafe._cuda import DeviceUpload, is_cuda
from crashsafe._log import logger, warn
from crashsafe.chain import ChainReader
from crashsafe.distributed.collective import PeerProblem
from crashsafe.distributed.group import SOLO, Coordination
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
from crashsafe.format.tree import ARRAY_NODES
from crashsafe.state.rebuild import to_value, unflatten
from crashsafe.storage.base import Store
from crashsafe.storage.oserror import storage_error
from crashsafe.storage.reader import read_manifest

__all__ = [
    "READ_ATTEMPTS",
    "array_ids",
    "check_device",
    "first_intact",
    "holding",
    "listed_steps",
    "manifest_of",
    "note_read",
    "on_damage",
    "read_state",
    "read_step",
    "read_value",
    "reading_error",
    "skip_damaged",
    "state_of",
]

_T = TypeVar("_T")

READ_ATTEMPTS = 5  # listings tried when every step tried vanished


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


_SEEN: ContextVar[list[str] | None] = ContextVar("crashsafe_damage_seen", default=None)


def skip_damaged(message: str) -> None:
    """Warn that a read skipped a damaged step (a CorruptCheckpointWarning), and tell the writer
    reading here, if any (:func:`on_damage`): its delta chains may run through that step."""
    seen = _SEEN.get()
    if seen is not None:
        seen.append(message)
    warn(message, CorruptCheckpointWarning)


@contextlib.contextmanager
def on_damage(reset: Callable[[], None]) -> Iterator[None]:
    """Call ``reset`` if the reads inside (in this thread) find a damaged step, raised or skipped:
    a writer then starts new delta chains, never one through the damage."""
    seen: list[str] = []
    token = _SEEN.set(seen)
    try:
        yield
    except CorruptCheckpointError:
        reset()
        raise
    finally:
        _SEEN.reset(token)
    if seen:
        reset()


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


def first_intact(
    stores: Sequence[Store],
    step: int | None,
    read: Callable[[Store, int, bool], _T],
    coord: Coordination = SOLO,
) -> tuple[int, _T] | None:
    """(step, ``read(store, step, last)``) of ``step``, or of the newest step that every process of
    ``coord`` reads intact, from any of ``stores`` (a step's local copy before its mirror's). A
    damaged step or copy is skipped with a warning, by every rank alike: while any rank finds its
    part damaged, every rank goes on to the next older one. ``last`` tells ``read`` that nothing is
    left to fall back to after it (always, for a step asked for by number: a restore verifies each of
    its copies before it changes anything). A step deleted while it was read is not damage: the steps
    are listed afresh. Another error on any rank is raised on every rank. A damaged ``step`` asked for
    by number raises (after its other tiers' copies). None if there is no step at all."""
    damage: dict[tuple[int, int], str] = {}
    gone: set[tuple[int, int]] = set()
    for _ in range(READ_ATTEMPTS):
        candidates = _candidates(stores, step, coord)
        gone.clear()  # deleted while read: no more a fallback than a damaged step, until listed again
        for n, (at, tier) in enumerate(candidates):
            if (at, tier) in damage:
                continue
            last = all(other in damage or other in gone for other in candidates[n + 1 :])
            result, kind, error = _attempt(read, stores[tier], at, last or step is not None)
            outcomes = coord.all_gather((kind, None if error is None else str(error)), f"reading step {at}")
            if kind == "error" and error is not None:
                raise error
            failed = _by_rank(outcomes, "error", coord)
            if failed:
                raise CrashsafeError(f"step {at} could not be read by every rank: {failed}")
            bad = _by_rank(outcomes, "damaged", coord)
            if not bad and not _by_rank(outcomes, "gone", coord):
                return at, cast(_T, result)
            if step is not None and last:  # the step asked for, and no other copy of it
                if coord.world == 1 and error is not None:
                    raise error
                raised = CorruptCheckpointError if bad else NoCheckpointError
                why = bad or _by_rank(outcomes, "gone", coord)
                raise raised(f"step {at} cannot be read by every rank: {why}")
            if not bad:
                gone.add((at, tier))
                continue
            damage[at, tier] = bad
            _skip(at, stores[tier], bad, step is not None, coord)
        if not gone:
            break
    if not damage and not gone:
        return None
    where = " and ".join(store.location for store in stores)
    damaged = "; ".join(damage[k] for k in sorted(damage, reverse=True))
    if gone:
        raise NoCheckpointError(
            f"every step of {where} was deleted while it was read, {READ_ATTEMPTS} times over"
            + (f" (the others are damaged: {damaged})" if damage else "")
            + "; another process is deleting steps faster than this one reads them. Try again"
        )
    raise CorruptCheckpointError(
        f"every checkpoint in {where} is damaged: {damaged}. Run `crashsafe verify` for details."
    )


def _candidates(stores: Sequence[Store], step: int | None, coord: Coordination) -> list[tuple[int, int]]:
    """(step, tier) to try, newest first, a step's local copy before its mirror's: every copy of
    ``step``, or every step; listed by the leader for every rank."""
    if step is not None and len(stores) == 1:
        return [(step, 0)]  # one tier: no listing needed (a request, on an object store)
    listed = coord.agree(lambda: listed_steps(stores), "listing steps")
    if step is not None:
        return [(step, tier) for tier, steps in enumerate(listed) if step in steps] or [(step, 0)]
    every = [(at, tier) for tier, steps in enumerate(listed) for at in steps]
    return sorted(every, key=lambda candidate: (-candidate[0], candidate[1]))


def _attempt(
    read: Callable[[Store, int, bool], _T], store: Store, step: int, last: bool
) -> tuple[_T | None, str, CrashsafeError | None]:
    """``read``'s result, or what kept it: "damaged", "gone" (deleted while read), "peer" (another
    rank's part cannot be restored, so this one left first), or "error" (anything else of ours)."""
    try:
        return read(store, step, last), "ok", None
    except PeerProblem:
        return None, "peer", None
    except (CorruptCheckpointError, StorageError) as exc:
        return None, "damaged", exc
    except NoCheckpointError as exc:
        return None, "gone", exc
    except CrashsafeError as exc:
        return None, "error", exc


def _by_rank(outcomes: list[tuple[str, str | None]], kind: str, coord: Coordination) -> str:
    """The messages of the ranks whose outcome is ``kind``, each named by its rank where there are several."""
    found = [(rank, message) for rank, (what, message) in enumerate(outcomes) if what == kind]
    if coord.world == 1:
        return "; ".join(str(message) for _, message in found)
    return "; ".join(f"rank {rank}: {message}" for rank, message in found)


def _skip(step: int, store: Store, bad: str, copy: bool, coord: Coordination) -> None:
    """Say that a damaged step (``copy``: a damaged copy of the step asked for) is skipped."""
    if copy:
        skip_damaged(f"skipping a damaged copy: {bad}. Reading step {step} from the next tier.")
        logger().warning("fell back from the copy of step %d in %s because %s", step, store.location, bad)
    elif coord.world > 1:
        skip_damaged(f"skipping damaged checkpoint step {step} ({bad}); all ranks fall back to an older one")
        logger().warning("fell back from step %d because %s", step, bad)
    else:
        skip_damaged(f"skipping damaged checkpoint: {bad}. Falling back to an older step.")
        logger().warning("fell back from step %d because %s", step, bad)


def read_step(
    stores: Sequence[Store], step: int | None, numpy: bool, rank: int | None, device: Any, coord: Coordination
) -> tuple[int, dict[str, Any]] | None:
    """(step, the state as saved) of ``step``, or of the newest step every rank reads intact."""
    read = lambda store, at, last: read_state(store, at, numpy, rank, None, device)  # noqa: E731
    return first_intact(stores, step, read, coord)


def manifest_of(stores: Sequence[Store], step: int | None, where: str) -> Manifest:
    """The validated manifest of ``step`` (None: the newest), from the first store holding it intact."""
    if step is None:
        steps = sorted({s for listed in listed_steps(stores) for s in listed})
        if not steps:
            raise NoCheckpointError(f"no committed checkpoint in {where}")
        step = steps[-1]
    found = first_intact(stores, step, lambda store, at, last: read_manifest(store, at))
    assert found is not None  # a step asked for is read or raises
    return found[1]


def note_read(step: int | None, asked: int | None, where: str, began: float) -> int | None:
    """Log the one line of a read: "resumed from step N" for the newest intact step (``asked`` None),
    "loaded step N" for a step asked for by number; where from and how long it took
    (``time.perf_counter()`` at ``began``). Returns ``step``."""
    if step is not None:
        what = "resumed from" if asked is None else "loaded"
        logger().info("%s step %d (%s, %.2f s)", what, step, where, time.perf_counter() - began)
    return step
