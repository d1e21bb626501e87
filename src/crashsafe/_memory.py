"""Large byte buffers backed by transparent huge pages: 512x fewer page faults on first touch."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

__all__ = ["alloc_bytes"]

_HUGE_MIN = 1 << 20


def alloc_bytes(nbytes: int, *, prefault: bool = False) -> np.ndarray[Any, Any]:
    """A writable uint8 buffer; ``prefault`` touches every page now rather than on first use."""
    if nbytes < _HUGE_MIN:
        buf = np.empty(nbytes, dtype=np.uint8)
    else:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            region.madvise(mmap.MADV_HUGEPAGE)
        buf = np.frombuffer(region, dtype=np.uint8)
    if prefault:
        buf.fill(0)
    return buf
