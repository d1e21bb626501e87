"""Get each leaf's bytes as a C-contiguous numpy array: copied into reusable staging buffers
(async saves, so training may continue) or viewed without a copy (sync saves).

Staging buffers are allocated once, pre-faulted (the first touch of fresh memory is ~7x slower
than a copy into warm memory) and reused by every later save of the same shapes. A CUDA tensor's
buffer is pinned (page-locked) host memory, up to a cap: the link copies into it at full speed and
asynchronously, on the device's copy stream (:mod:`crashsafe._cuda`). Pinning is slow, so a tensor
seen for the first time is cloned on its device instead, where the device has room (a copy at
device-memory speed), and the background writer pins its buffer and copies it down.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from crashsafe._cuda import (
    DeviceCopies,
    default_pinned_limit,
    device_room,
    is_cuda,
    pinned_buffer,
    pinned_size,
)
from crashsafe._log import logger, warn
from crashsafe._memory import alloc_bytes
from crashsafe.errors import CrashsafeWarning
from crashsafe.format.dtypes import storage_dtype
from crashsafe.state.rebuild import to_value, unflatten
from crashsafe.state.tree import ArrayLeaf, flatten
from crashsafe.state.unchanged import ChangeWatch, Unchanged

__all__ = ["StagingPool", "detached_copy", "landed", "view_bytes"]

_ALIGN = 512  # bytes: where each buffer carved out of one pinned allocation starts


@dataclass
class _Slot:
    """One leaf's staging buffer and its views in the leaf's element type and shape (kept so a
    repeated save costs one copy, not a rebuild of the views)."""

    buffer: np.ndarray[Any, Any]
    key: tuple[str, str, tuple[int, ...]]  # kind, dtype, shape
    typed: np.ndarray[Any, Any]
    tensor: Any  # a torch view of ``buffer`` for torch leaves, else None
    pinned: int = 0  # bytes of ``buffer`` that are page-locked


class StagingPool:
    """Staging buffers by state path; one buffer per leaf, reused while its size is unchanged.

    Copies of CUDA tensors are queued while the state is walked and issued together by
    :meth:`issue`; the thread that reads the buffers first calls :meth:`settle`, which brings down
    the clones of tensors seen for the first time (and with ``every``, waits for all copies), then
    :meth:`ready` before it reads a buffer whose copy it did not wait for, and :meth:`release` when
    done. ``pinned_bytes`` caps the page-locked staging memory, counted as torch's pinned allocator
    hands it out (rounded up to a power of two; default: :func:`~crashsafe._cuda.default_pinned_limit`);
    tensors beyond it are staged in pageable memory, at a third of the link's speed, said once in a
    warning. ``clones=False``: tensors seen for the first time are never cloned on their device.
    """

    def __init__(self, pinned_bytes: int | None = None, *, clones: bool = True) -> None:
        self._slots: dict[str, _Slot] = {}
        self._pinned_limit = pinned_bytes
        self._pinned = 0  # bytes of pinned memory the slots hold
        self._clone_new = clones
        self._copies = DeviceCopies()
        self._clones: dict[str, tuple[ArrayLeaf, int]] = {}  # path -> the leaf (its clone), its ticket
        self._tickets: dict[str, int] = {}  # path -> the ticket of its copy into its buffer
        self._room: dict[int, int] = {}  # device -> bytes left for clones in this snapshot
        self._watch: ChangeWatch | None = None  # this snapshot's: what it need not copy
        self.unchanged: dict[str, Unchanged] = {}  # this snapshot's tensors it did not copy
        self._warned = False
        self.allocating = 0.0  # seconds spent allocating buffers, in all
        self.allocations = 0  # buffers allocated, in all
        self._save_began = (0.0, 0)  # allocating and allocations as the current save began
        self._recurs = False  # the save before allocated too: this one's allocations recur

    def begin_save(self) -> None:
        """A save starts (the one before finished, its background part included): whether that one
        allocated buffers decides whether this one's allocations are one-time :attr:`setup`."""
        self._recurs = self.allocations > self._save_began[1]
        self._save_began = (self.allocating, self.allocations)

    @property
    def setup(self) -> float:
        """Seconds the current save spent allocating buffers, if that is one-time: the first save's, or
        one after a save that allocated none (a tensor that changed shape once). A save after one that
        allocated too (shapes that change at every save) pays it again: none of it is setup."""
        return 0.0 if self._recurs else self.allocating - self._save_began[0]

    @property
    def nbytes(self) -> int:
        return sum(slot.buffer.nbytes for slot in self._slots.values())

    @property
    def pinned_nbytes(self) -> int:
        return self._pinned

    @property
    def waiting(self) -> set[str]:
        """The paths whose device copies a reader must wait for (:meth:`ready`)."""
        return set(self._tickets)

    def capture(self, leaves: list[ArrayLeaf], watch: ChangeWatch | None = None) -> list[Any]:
        """Copy every leaf into its staging buffer; return typed views of the copies (for a CUDA
        tensor seen for the first time, its clone on the device: see :meth:`landed`), or, for a
        tensor ``watch`` proves unchanged, its :class:`Unchanged`. Device copies are issued before
        it returns; their bytes are there after :meth:`settle`."""
        self.begin(watch)
        self.retain({leaf.path for leaf in leaves})
        self.prehash([(leaf.path, leaf.source) for leaf in leaves if leaf.kind == "torch" and leaf.nbytes])
        copies = [self._take(leaf) for leaf in leaves]
        self.issue()
        return copies

    def begin(self, watch: ChangeWatch | None = None) -> None:
        """Start a snapshot (with ``watch``: of tensors it need not copy): forget device copies queued
        by one that was given up."""
        self._copies = DeviceCopies()
        self._clones.clear()
        self._tickets.clear()
        self._room.clear()
        self.unchanged = {}
        self._watch = watch
        if watch is not None:
            watch.begin()

    def stage(self, leaf: ArrayLeaf) -> Any:
        """Copy one leaf into its staging buffer (unless the snapshot's watch proves it unchanged);
        return the copy as the leaf's own kind (a torch tensor for a tensor, else the typed array).
        A CUDA tensor's copy is queued (:meth:`issue`)."""
        typed = self._take(leaf)
        if isinstance(typed, Unchanged):
            return self._slots[leaf.path].tensor  # what it holds is not read: the step refers to it
        if leaf.kind != "torch" or not isinstance(typed, np.ndarray):
            return typed
        tensor = self._slots[leaf.path].tensor
        return tensor if tensor is not None else to_value("torch", leaf.dtype, typed)  # 0 bytes

    def unchanged_tensor(self, path: str, tensor: Any) -> bool:
        """Whether CPU ``tensor`` (kept at ``path``, in a buffer an earlier save staged it in) is
        proven unchanged by the snapshot's watch: then it is not copied."""
        if self._watch is None:
            return False
        slot = self._slots.get(path)
        held = slot.typed if slot is not None else None
        found = self._watch.check(path, tensor, held=held, live=False)
        if found is not None:
            self.unchanged[path] = found
        return found is not None

    def prehash(self, items: list[tuple[str, Any]]) -> None:
        """Hash the CPU tensors among ``(path, tensor)`` items on every core before they are checked
        one by one (:meth:`ChangeWatch.prehash`)."""
        if self._watch is not None:
            self._watch.prehash(items)

    def copied(self, path: str, tensor: Any) -> None:
        """CPU ``tensor`` at ``path`` was copied into its buffer at this save point (the watch learns it)."""
        if self._watch is not None:
            self._watch.saw(path, tensor, buffer=self._slots[path].typed)

    def _take(self, leaf: ArrayLeaf) -> Any:
        """A leaf's copy, or its Unchanged if the snapshot's watch proves it unchanged (a tensor with
        a buffer of its shape: the buffer still holds the committed bytes)."""
        watch = self._watch
        if watch is None or leaf.kind != "torch" or not leaf.nbytes:
            return self._copy(leaf)
        device = self._copies if is_cuda(leaf.source) else None
        slot = self._slots.get(leaf.path)
        if slot is not None and slot.key == (leaf.kind, leaf.dtype, leaf.shape):
            found = watch.check(leaf.path, leaf.source, held=slot.typed, live=False, device=device)
            if found is not None:
                self.unchanged[leaf.path] = found
                return found
        copy = self._copy(leaf)
        slot = self._slots.get(leaf.path)  # none yet for a clone: its buffer comes in settle()
        watch.saw(leaf.path, leaf.source, buffer=None if slot is None else slot.typed, device=device)
        return copy

    def issue(self) -> None:
        """Issue the queued device copies (ordered after the training stream, which waits for them)."""
        self._copies.issue()
        self._room.clear()

    def settle(self, *, every: bool = True) -> None:
        """Copy each clone of a first-seen tensor into newly pinned buffers (off the training thread:
        pinning is slow), then drop the clone; with ``every``, also wait until every copy landed."""
        if every:
            self._copies.wait()
        if not self._clones:
            return
        leaves = [leaf for leaf, _ in self._clones.values()]
        for _, ticket in self._clones.values():
            self._copies.ready(ticket)
        self._clones.clear()
        landing = DeviceCopies()
        for leaf, buffer in zip(leaves, self._pinned_buffers(leaves), strict=True):
            slot = self._slot(leaf, buffer)
            landing.add(slot.tensor, leaf.source)
            if self._watch is not None:
                self._watch.staged(leaf.path, slot.typed)
        landing.issue(ordered=False)  # the clones are the copy stream's own: nothing to wait for
        landing.wait()

    def ready(self, path: str) -> None:
        """Block until the copy of ``path`` into its staging buffer landed (no copy: at once)."""
        ticket = self._tickets.get(path)
        if ticket is not None:
            self._copies.ready(ticket)

    def release(self) -> None:
        """The snapshot was read: wait for any copy still out and let go of the sources."""
        self._copies.wait()

    def landed(self, path: str) -> np.ndarray[Any, Any]:
        """The typed staging buffer of ``path`` (after :meth:`settle`: a clone's values are there)."""
        return self._slots[path].typed

    def staged(self, path: str, dtype: str, shape: tuple[int, ...]) -> Any | None:
        """The torch view of the buffer an earlier save staged a tensor of this dtype and shape in
        at ``path`` (the caller copies into it), or None (use stage())."""
        slot = self._slots.get(path)
        if slot is None or slot.key != ("torch", dtype, shape):
            return None
        return slot.tensor

    def retain(self, paths: set[str]) -> None:
        """Free the buffers of every path not in ``paths``."""
        for stale in self._slots.keys() - paths:
            self._drop(stale)

    def _drop(self, path: str) -> None:
        slot = self._slots.pop(path, None)
        if slot is not None:
            self._pinned -= slot.pinned

    def _slot(self, leaf: ArrayLeaf, buffer: tuple[np.ndarray[Any, Any], int] | None = None) -> _Slot:
        """The slot of ``leaf``: its own if it fits, else a new one (in ``buffer``, given with its
        pinned bytes, if any: else in one of its own, pinned for a CUDA tensor while the cap allows)."""
        key = (leaf.kind, leaf.dtype, leaf.shape)
        slot = self._slots.get(leaf.path)
        if slot is not None and slot.key == key and buffer is None:
            return slot
        if buffer is None and slot is not None and slot.buffer.nbytes == leaf.nbytes:
            buffer = (slot.buffer, slot.pinned)
        self._drop(leaf.path)
        if buffer is None:
            began = time.perf_counter()
            if is_cuda(leaf.source) and self._may_pin(pinned_size(leaf.nbytes)):
                buffer = (pinned_buffer(leaf.nbytes).numpy(), pinned_size(leaf.nbytes))
            else:
                buffer = (alloc_bytes(leaf.nbytes, prefault=True), 0)
            self.allocating += time.perf_counter() - began
            self.allocations += 1
        typed = buffer[0].view(storage_dtype(leaf.dtype)).reshape(leaf.shape)
        tensor = None
        if leaf.kind == "torch" and leaf.nbytes:
            import torch

            tensor = torch.from_numpy(buffer[0]).view(leaf.source.dtype).view(leaf.shape)
        slot = self._slots[leaf.path] = _Slot(buffer[0], key, typed, tensor, buffer[1])
        self._pinned += buffer[1]
        return slot

    def _pinned_buffers(self, leaves: list[ArrayLeaf]) -> list[tuple[np.ndarray[Any, Any], int] | None]:
        """Buffers for ``leaves`` carved out of one pinned allocation (one rounding to a power of
        two for all, not one each), with each one's share of its pinned bytes; Nones (each leaf
        then gets a slot of its own) if the cap does not allow it."""
        aligned = [-(-leaf.nbytes // _ALIGN) * _ALIGN for leaf in leaves]
        total = sum(aligned)
        if total == 0 or not self._may_pin(pinned_size(total)):
            return [None] * len(leaves)
        began = time.perf_counter()
        arena = pinned_buffer(total).numpy()
        self.allocating += time.perf_counter() - began
        self.allocations += 1
        share = pinned_size(total) / total
        buffers: list[tuple[np.ndarray[Any, Any], int] | None] = []
        at = 0
        for leaf, size in zip(leaves, aligned, strict=True):
            buffers.append((arena[at : at + leaf.nbytes], round(size * share)))
            at += size
        return buffers

    def _may_pin(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more pinned bytes stay within the cap (warned once when they do not)."""
        limit = default_pinned_limit() if self._pinned_limit is None else self._pinned_limit
        if self._pinned + nbytes <= limit:
            return True
        if not self._warned:
            self._warned = True
            message = (
                f"staging CUDA tensors needs more than pinned_bytes={limit} bytes of pinned host memory; "
                "the rest is staged in pageable memory, which the GPU copies into about 3x slower and "
                "synchronously. Raise pinned_bytes if the machine has the memory"
            )
            warn(message, CrashsafeWarning)
            logger().warning("%s", message)
        return False

    def _copy(self, leaf: ArrayLeaf) -> Any:
        if leaf.nbytes and is_cuda(leaf.source):
            return self._copy_from_device(leaf)
        slot = self._slot(leaf)
        if leaf.nbytes == 0:
            return slot.typed
        if slot.tensor is not None:
            slot.tensor.copy_(leaf.source.detach())
        elif leaf.kind == "bytes":
            slot.buffer[:] = np.frombuffer(leaf.source, dtype=np.uint8)
        else:
            np.copyto(slot.typed, leaf.source)
        return slot.typed

    def _copy_from_device(self, leaf: ArrayLeaf) -> Any:
        """Queue a CUDA tensor's copy into its pinned buffer; a tensor that has no buffer yet is
        cloned on its device instead (pools that clone), if the device has room for the clone."""
        source = leaf.source.detach()
        slot = self._slots.get(leaf.path)
        if self._clone_new and (slot is None or slot.buffer.nbytes != leaf.nbytes):
            device = source.device.index
            room = self._room.get(device)
            room = self._room[device] = device_room(source.device) if room is None else room
            if leaf.nbytes <= room:
                self._room[device] = room - leaf.nbytes
                clone, ticket = self._copies.clone_of(source)
                self._clones[leaf.path] = (dataclasses.replace(leaf, source=clone), ticket)
                return clone
        slot = self._slot(leaf)
        self._tickets[leaf.path] = self._copies.add(slot.tensor, source)
        return slot.typed

    def clear(self) -> None:
        self._copies.wait()
        self._slots.clear()
        self._clones.clear()
        self._pinned = 0


def landed(pool: StagingPool, leaf: ArrayLeaf, copy: Any) -> np.ndarray[Any, Any]:
    """A leaf's staged bytes: the copy :meth:`StagingPool.capture` gave, or its clone's landing place."""
    return copy if isinstance(copy, np.ndarray) else pool.landed(leaf.path)


def view_bytes(leaf: ArrayLeaf) -> np.ndarray[Any, Any]:
    """The leaf as a contiguous array in its storage dtype, without copying when possible."""
    sd = storage_dtype(leaf.dtype)
    if leaf.kind == "torch":
        t = _plain_cpu(leaf.source)
        if t.numel() == 0:
            return np.empty(leaf.shape, dtype=sd)
        import torch

        flat: np.ndarray[Any, Any] = t.reshape(-1).view(torch.uint8).numpy()
        return flat.view(sd).reshape(leaf.shape)
    if leaf.kind == "bytes":
        return np.frombuffer(leaf.source, dtype=np.uint8)
    array = np.asarray(leaf.source, dtype=sd)  # ascontiguousarray would turn 0-d into 1-d
    return array if array.flags.c_contiguous else array.copy()


def _plain_cpu(tensor: Any) -> Any:
    """``tensor``'s values in a contiguous CPU tensor without the lazy conj/neg/zero bits that
    ``.numpy()`` refuses: the tensor itself when it already is one, else a copy."""
    t = tensor.detach()
    if t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg() or t._is_zerotensor()):
        return t
    import torch

    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def detached_copy(state: object, pool: StagingPool) -> Any:
    """``state`` as plain values whose arrays live in ``pool``'s staging buffers: a point-in-time copy
    another thread can save while training goes on, until the next copy reuses the buffers.

    Views of one tensor (tied weights) stay views of one staged tensor; objects with
    ``state_dict()`` become that dict.
    """
    tree, leaves = flatten(state)
    copies = pool.capture(leaves)
    pool.settle()  # its caller reads the copy on another thread at once
    arrays = [landed(pool, leaf, copy) for leaf, copy in zip(leaves, copies, strict=True)]
    pool.release()
    values = [to_value(leaf.kind, leaf.dtype, array) for leaf, array in zip(leaves, arrays, strict=True)]
    return unflatten(tree, values)
