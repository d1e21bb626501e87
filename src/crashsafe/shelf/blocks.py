"""The arena's mapped bytes and the blocks in them: allocation, the views handed out per block, and
blocks pinned until those views are gone.

Every array handed out is a view of its block, registered here (one per block and shape). A block
freed while such a view lives is *pinned*, not reused, and freed by a later sweep once its views
are gone: a live array never shows another variable's bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from crashsafe.shelf.alloc import Allocator
from crashsafe.shelf.arena import Arena
from crashsafe.shelf.errors import ShelfFullError
from crashsafe.shelf.meta import NUMERIC_DTYPES, Entry

__all__ = ["Blocks", "ViewRef"]

_Array = np.ndarray[Any, Any]
ViewRef = weakref.ref[_Array]


class Blocks:
    """The mapped arena of a shelf: its bytes (``mv``, ``u8``), its allocator, and its live views.

    :meth:`map` maps the arena (again after it grew), :meth:`track` starts allocating once the
    committed metadata says which blocks are used, :meth:`unmap` lets the mapping go.
    """

    def __init__(self, arena: Arena, path: Path) -> None:
        self._arena = arena
        self.path = path
        self.views: dict[int, list[ViewRef]] = {}  # block offset -> the views handed out of it
        self.pinned: set[int] = set()  # freed blocks waiting for their views to die
        self._alloc = Allocator(0, 0)

    def map(self) -> None:
        self.mv = memoryview(self._arena.mm)
        self.u8 = np.frombuffer(self.mv, dtype=np.uint8)
        # numpy keeps no buffer export of its own; this ctypes array does, and every view handed
        # out is based on it, so the mapping outlives every view (and derived view)
        self._owner: Any = (ctypes.c_char * self._arena.length).from_buffer(self._arena.mm)

    def unmap(self) -> None:
        """Make every view read-only and release the mapping (views still alive keep it readable)."""
        for refs in self.views.values():
            for ref in refs:
                view = ref()
                if view is not None:
                    view.flags.writeable = False
        with contextlib.suppress(AttributeError):
            del self.u8, self._owner
        with contextlib.suppress(AttributeError, BufferError):
            self.mv.release()

    def grow(self, size: int) -> None:
        """Grow the arena file to ``size`` bytes (while no view is handed out) and map it again."""
        self.unmap()
        self._arena.grow(size)
        self.map()

    def track(self, start: int, end: int, used: Iterable[tuple[int, int]]) -> None:
        """Allocate from ``[start, end)``, where the ``(offset, nbytes)`` blocks are in use."""
        self._alloc = Allocator(start, end)
        for offset, nbytes in used:
            self._alloc.mark(offset, nbytes)

    @property
    def used(self) -> int:
        return self._alloc.used

    def sync(self) -> None:
        """An ordering point: every store made so far is durable when this returns."""
        self._arena.sync()

    # ------------------------------------------------------------------ allocation and pins

    def alloc(self, nbytes: int, name: str | None, role: str = "") -> int:
        """A free block of ``nbytes`` for ``role`` + ``name`` (None: a reserved array), sweeping the
        pins if none is free; raises :class:`ShelfFullError` naming it if there is still none."""
        offset = self._alloc.alloc(nbytes)
        if offset is None:
            self.sweep_pins()
            offset = self._alloc.alloc(nbytes)
        if offset is None:
            alloc = self._alloc
            raise ShelfFullError(
                f"the shelf {self.path} is full: no free block for {role}{name or 'a reserved array'!r} "
                f"({nbytes} bytes; the "
                f"largest free block has {alloc.largest_gap()} of {alloc.end - alloc.start} bytes). The "
                "transaction is rolled back and the shelf's data is intact. Delete variables, or "
                "reopen with a larger size= to grow the arena."
            )
        return offset

    def release(self, offset: int) -> None:
        """Free a block now, or once the views still pointing into it are gone."""
        if self.live_views(offset):
            self.pinned.add(offset)
        else:
            self.views.pop(offset, None)
            self._alloc.release(offset)

    def sweep_pins(self) -> None:
        """Free the pinned blocks whose views are gone."""
        for offset in list(self.pinned):
            if not self.live_views(offset):
                self.pinned.discard(offset)
                self.views.pop(offset, None)
                self._alloc.release(offset)

    def live_views(self, offset: int) -> bool:
        refs = self.views.get(offset)
        if not refs:
            return False
        refs[:] = [r for r in refs if r() is not None]
        return bool(refs)

    # ------------------------------------------------------------------ bytes and views

    def digest(self, offset: int, nbytes: int) -> int:
        return xxhash.xxh3_64_intdigest(self.mv[offset : offset + nbytes])

    def typed(self, entry: Entry) -> _Array:
        """``entry``'s block as an array (for copying; not a view handed out)."""
        return np.ndarray(entry.shape, NUMERIC_DTYPES[entry.dtype], buffer=self.mv, offset=entry.offset)

    def view(self, entry: Entry, opened: list[ViewRef] | None = None) -> _Array:
        """The live view of ``entry``'s block (one per block and shape): read-only, or writable if
        ``opened`` is given, which lists the views made writable here (read-only again later)."""
        writable = opened is not None
        refs = self.views.get(entry.offset)
        if refs is None:
            refs = self.views[entry.offset] = []
        for ref in refs:
            view = ref()
            if view is not None and view.shape == entry.shape:
                flags = view.flags
                if flags.writeable == writable:
                    return view
                flags.writeable = writable
                break
        else:
            view = np.ndarray(entry.shape, NUMERIC_DTYPES[entry.dtype], buffer=self._owner,
                              offset=entry.offset)  # writable, as its buffer is
            ref = weakref.ref(view)
            refs.append(ref)
            if not writable:
                view.flags.writeable = False
        if opened is not None:
            opened.append(ref)
        return view

    def fresh_view(self, shape: tuple[int, ...], dtype: np.dtype[Any], offset: int,
                   opened: list[ViewRef]) -> _Array:
        """A writable array over the new block at ``offset``, its only view (listed in ``opened``)."""
        view: _Array = np.ndarray(shape, dtype, buffer=self._owner, offset=offset)
        ref = weakref.ref(view)
        self.views[offset] = [ref]
        opened.append(ref)
        return view

    def open_views(self, offset: int, opened: list[ViewRef]) -> None:
        """Make the views of block ``offset`` writable, listing in ``opened`` those it changed."""
        for ref in self.views.get(offset, ()):
            view = ref()
            if view is not None and not view.flags.writeable:
                view.flags.writeable = True
                opened.append(ref)

    def close_views(self, offset: int) -> None:
        """Make the views of block ``offset`` read-only (its variable no longer uses it)."""
        for ref in self.views.get(offset, ()):
            view = ref()
            if view is not None and view.flags.writeable:
                view.flags.writeable = False

    def is_view(self, offset: int, data: object) -> bool:
        """Is ``data`` one of the views handed out of block ``offset``?"""
        return any(ref() is data for ref in self.views.get(offset, ()))
