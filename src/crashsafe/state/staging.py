"""Get each leaf's bytes as a C-contiguous numpy array: copied into reusable staging buffers
(async saves, so training may continue) or viewed without a copy (sync saves).

Staging buffers are allocated once, pre-faulted (the first touch of fresh memory is ~7x slower
than a copy into warm memory) and reused by every later save of the same shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from crashsafe._memory import alloc_bytes
from crashsafe.format.dtypes import storage_dtype
from crashsafe.state.rebuild import to_value, unflatten
from crashsafe.state.tree import ArrayLeaf, flatten

__all__ = ["StagingPool", "detached_copy", "view_bytes"]


@dataclass
class _Slot:
    """One leaf's staging buffer and its views in the leaf's element type and shape (kept so a
    repeated save costs one copy, not a rebuild of the views)."""

    buffer: np.ndarray[Any, Any]
    key: tuple[str, str, tuple[int, ...]]  # kind, dtype, shape
    typed: np.ndarray[Any, Any]
    tensor: Any  # a torch view of ``buffer`` for torch leaves, else None


class StagingPool:
    """Staging buffers by state path; one buffer per leaf, reused while its size is unchanged."""

    def __init__(self) -> None:
        self._slots: dict[str, _Slot] = {}

    @property
    def nbytes(self) -> int:
        return sum(slot.buffer.nbytes for slot in self._slots.values())

    def capture(self, leaves: list[ArrayLeaf]) -> list[np.ndarray[Any, Any]]:
        """Copy every leaf into its staging buffer; return typed views of the copies."""
        self.retain({leaf.path for leaf in leaves})
        return [self._copy(leaf) for leaf in leaves]

    def stage(self, leaf: ArrayLeaf) -> Any:
        """Copy one leaf into its staging buffer; return the copy as the leaf's own kind (a torch
        tensor for a tensor, else the typed array)."""
        typed = self._copy(leaf)
        if leaf.kind != "torch":
            return typed
        tensor = self._slots[leaf.path].tensor
        return tensor if tensor is not None else to_value("torch", leaf.dtype, typed)  # 0 bytes

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
            del self._slots[stale]

    def _slot(self, leaf: ArrayLeaf) -> _Slot:
        key = (leaf.kind, leaf.dtype, leaf.shape)
        slot = self._slots.get(leaf.path)
        if slot is not None and slot.key == key:
            return slot
        if slot is not None and slot.buffer.nbytes == leaf.nbytes:
            buffer = slot.buffer
        else:
            buffer = alloc_bytes(leaf.nbytes, prefault=True)
        typed = buffer.view(storage_dtype(leaf.dtype)).reshape(leaf.shape)
        tensor = None
        if leaf.kind == "torch" and leaf.nbytes:
            import torch

            tensor = torch.from_numpy(buffer).view(leaf.source.dtype).view(leaf.shape)
        slot = self._slots[leaf.path] = _Slot(buffer, key, typed, tensor)
        return slot

    def _copy(self, leaf: ArrayLeaf) -> np.ndarray[Any, Any]:
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

    def clear(self) -> None:
        self._slots.clear()


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
    arrays = pool.capture(leaves)
    values = [to_value(leaf.kind, leaf.dtype, array) for leaf, array in zip(leaves, arrays, strict=True)]
    return unflatten(tree, values)
