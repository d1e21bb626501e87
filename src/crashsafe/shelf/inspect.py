"""Read-only report of a shelf file: layout, variables, versions, last transaction, pending
rollback and (optionally) every variable's checksum. Takes no lock and changes nothing, so it can
look at a shelf another process has open, or at one a crash left with a transaction to roll back.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from crashsafe.errors import CrashsafeError
from crashsafe.shelf import recovery
from crashsafe.shelf.alloc import reserved
from crashsafe.shelf.arena import open_regular
from crashsafe.shelf.errors import NotAShelfError, ShelfError
from crashsafe.shelf.layout import PAGE, Superblock
from crashsafe.shelf.loop_record import interrupted, lost, read_committed

__all__ = ["ShelfReport", "VarReport", "inspect_shelf"]

_CHUNK = 64 << 20


@dataclass(frozen=True)
class VarReport:
    """One variable as committed; ``intact`` is None when checksums were not verified."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    version: int
    value: Any
    intact: bool | None


@dataclass(frozen=True)
class ShelfReport:
    """Everything ``crashsafe shelf inspect`` shows."""

    path: Path
    format_version: int
    created: float
    size: int
    data_bytes: int
    used: int
    seq: int
    last_transaction: dict[str, Any]
    last_rollback: dict[str, Any] | None
    spare_slot: str
    pending: recovery.Incomplete | None
    variables: tuple[VarReport, ...]
    loop: tuple[str, ...] = ()  # the variables of the shelf's loop, if it has one
    lost: tuple[int, int] | None = None  # committed loop transactions whose records are damaged

    @property
    def damaged(self) -> list[str]:
        return [v.name for v in self.variables if v.intact is False]


def inspect_shelf(
    path: str | os.PathLike[str],
    *,
    verify: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> ShelfReport:
    """Describe the shelf at ``path``; foreign or damaged files raise with a clear message.

    ``progress(done_bytes, total_bytes)`` is called while checksums are verified.
    """
    path = Path(path)
    try:
        fd = open_regular(path, os.O_RDONLY)
    except OSError as exc:
        raise ShelfError(f"cannot open {path}: {exc.strerror}") from None
    try:
        length = os.fstat(fd).st_size
        if length < PAGE:
            raise NotAShelfError(f"{path} is not a crashsafe shelf: it is shorter than one page")
        mapped = mmap.mmap(fd, length, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    with mapped:
        return _report_mapped(path, mapped, length, verify, progress)


def _report_mapped(
    path: Path, mapped: mmap.mmap, length: int, verify: bool, progress: Callable[[int, int], None] | None
) -> ShelfReport:
    """:func:`_report` on the mapping. A shelf error leaves without its traceback: the frames in it
    hold slices of the mapping, which would make closing it fail with BufferError ("cannot close
    exported pointers exist") in place of the error that says what is wrong with the file."""
    buf = memoryview(mapped)
    try:
        return _report(path, buf, length, verify, progress)
    except CrashsafeError as exc:
        exc.__context__ = exc.__cause__ = None  # an exception it was raised from holds frames too
        raise exc.with_traceback(None) from None
    finally:
        buf.release()


def _report(
    path: Path, buf: memoryview, length: int, verify: bool, progress: Callable[[int, int], None] | None
) -> ShelfReport:
    sb = Superblock.unpack(bytes(buf[:PAGE]), path)
    meta, spare = read_committed(buf, sb, path)
    if length < meta.size:
        raise ShelfError(f"{path} is shorter ({length} bytes) than its arena ({meta.size}); it was truncated")
    pending = recovery.scan(buf, sb, meta.seq) or interrupted(buf, meta)
    gone = None if pending else lost(buf, meta)
    pending_targets = {r.target for r in pending.undo} if pending else set()
    total = sum(e.nbytes for e in meta.vars.values() if e.has_block) if verify else 0
    done = 0
    variables = []
    for name, e in sorted(meta.vars.items()):
        intact = None
        if verify and e.has_block:
            if e.offset in pending_targets:
                intact = None  # may be mid-write: the next writable open restores it
            else:
                intact = xxhash.xxh3_64_intdigest(buf[e.offset : e.offset + e.nbytes]) == e.digest
            done += e.nbytes
            if progress is not None:
                progress(done, total)
        value = e.value if e.kind == "scalar" else _preview(buf, e.kind, e.offset, e.nbytes)
        variables.append(VarReport(name, e.kind, e.dtype, e.shape, e.nbytes, e.version, value, intact))
    used = sum(reserved(e.nbytes) for e in meta.vars.values() if e.has_block)
    loop = meta.loop
    if loop is not None:  # its spares and records
        used += sum(reserved(nbytes) for _, nbytes in loop.blocks(meta.vars))
    return ShelfReport(path, sb.version, sb.created, meta.size, meta.size - sb.data_start, used, meta.seq,
                       dict(meta.tx), meta.rollback, spare, pending, tuple(variables),
                       loop.names if loop is not None else (), gone[:2] if gone else None)


def _preview(buf: memoryview, kind: str, offset: int, nbytes: int) -> Any:
    """The start of a str/bytes value (arrays are described, not shown)."""
    if kind == "array":
        return None
    head = bytes(buf[offset : offset + min(nbytes, 60)])
    return head.decode(errors="replace") if kind == "str" else head
