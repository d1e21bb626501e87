"""Fingerprints of a device tensor's bytes, computed on the device: how a save proves a CUDA tensor
unchanged without copying it to the host (docs/unchanged.md).

The bytes are read as int8 rows of ``ROW`` bytes and multiplied by a secret random int8 matrix of
``COLUMNS`` columns (``torch._int_mm``: exact int32 sums, no overflow for rows of 4096 bytes). The
map is linear over the integers, so two byte strings get equal prints only if their difference ``d``
(a row of integers in [-255, 255]) has ``d . r = 0`` for every column ``r``; for a nonzero ``d``
each column does so with probability at most 1/255 (fix every key but one where ``d`` is nonzero:
one value of that key solves it), so a changed row goes unseen with probability at most
``255**-COLUMNS`` (2**-64). The keys are drawn per process from the OS, not from torch's RNG
(a save never moves the training's random state). The last bytes that fill no row are kept as they are.
"""

from __future__ import annotations

import os
import secrets
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["COLUMNS", "ROW", "DevicePrint", "changed", "differs", "print_of", "printable"]

ROW = 4096  # bytes per row: exact int32 sums (4096 * 128 * 127 < 2**31)
COLUMNS = 8  # independent keys: 255**-8 < 2**-63 per changed row
_MIN_ROWS = 17  # torch._int_mm wants more than 16 rows
_KEYS: dict[Any, Any] = {}  # device -> its int8 key matrix (ROW x COLUMNS)
_LOCK = threading.Lock()


def _forget_in_child() -> None:
    """In a forked child: the parent's device keys are not the child's, and a parent thread may have
    held the lock at the fork (as ``crashsafe._cuda`` does)."""
    global _LOCK
    _LOCK = threading.Lock()
    _KEYS.clear()


os.register_at_fork(after_in_child=_forget_in_child)


@dataclass(frozen=True)
class DevicePrint:
    """A tensor's fingerprint, on its device: one int32 row of ``COLUMNS`` sums per ``ROW`` bytes,
    and the bytes that fill no row."""

    rows: Any
    tail: Any


def printable(tensor: Any) -> bool:
    """Whether ``tensor`` can be fingerprinted: contiguous, plain bits (no lazy conjugate or
    negation), at least ``_MIN_ROWS`` rows of bytes, on a device whose int8 matrix product works."""
    return bool(
        tensor.is_contiguous()
        and not (tensor.is_conj() or tensor.is_neg())
        and tensor.numel() * tensor.element_size() >= _MIN_ROWS * ROW
        and _keys(tensor.device) is not None
    )


def print_of(tensor: Any) -> DevicePrint:
    """The fingerprint of ``tensor``'s bytes as they are once the work queued before it on the
    current stream is done (call it on the stream that must see them, as copies are)."""
    import torch

    flat = tensor.detach().reshape(-1).view(torch.uint8).view(torch.int8)
    whole = flat.numel() // ROW * ROW
    rows = torch._int_mm(flat[:whole].view(-1, ROW), _keys(flat.device))
    return DevicePrint(rows, flat[whole:].clone())


def differs(tensor: Any, before: DevicePrint) -> Any:
    """A one-element bool tensor on the device: whether ``tensor``'s bytes no longer match ``before``
    (queued on the current stream; nothing waits for it here)."""
    return changed(print_of(tensor), before)


def changed(now: DevicePrint, before: DevicePrint) -> Any:
    """A one-element bool tensor on the device: whether two prints differ (queued, not waited for)."""
    if now.rows.shape != before.rows.shape or now.tail.shape != before.tail.shape:
        import torch

        return torch.ones(1, dtype=torch.bool, device=now.rows.device)
    return (now.rows != before.rows).any().reshape(1) | (now.tail != before.tail).any().reshape(1)


def _keys(device: Any) -> Any:
    """The key matrix of ``device`` (column-major, as the int8 matrix product wants it), drawn once;
    None where that product fails (an old GPU, a build without it): its tensors are always copied."""
    import torch

    with _LOCK:
        if device not in _KEYS:
            try:
                generator = torch.Generator(device=device)
                generator.manual_seed(secrets.randbits(63))
                shape = (COLUMNS, ROW)
                drawn = torch.randint(-127, 128, shape, dtype=torch.int8, device=device, generator=generator)
                torch._int_mm(torch.zeros(_MIN_ROWS, ROW, dtype=torch.int8, device=device), drawn.t())
                _KEYS[device] = drawn.t()
            except (RuntimeError, NotImplementedError, AttributeError):
                _KEYS[device] = None
        return _KEYS[device]
