"""Undo records of the transaction in progress, and rolling a transaction back from them.

Record 0 is the transaction's BEGIN (written at its first change, so a crashed transaction is
always reported); each later record names a committed block about to be overwritten in place and
the free block its old bytes were copied to (made durable before the overwrite). A transaction numbered
``committed.seq + 1`` with a BEGIN is incomplete. Rolling back is idempotent, so a crash during
recovery is recovered by the next open.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

import crashsafe._faults as faults
from crashsafe.shelf.errors import CorruptShelfError
from crashsafe.shelf.layout import RECORD_BYTES, Record, Superblock
from crashsafe.shelf.meta import Meta

__all__ = ["Incomplete", "RecoveryInfo", "restore", "scan"]


@dataclass(frozen=True)
class RecoveryInfo:
    """What opening the shelf rolled back: the transaction number and the variables restored; or,
    with ``lost`` (how many), committed loop iterations up to ``seq`` whose records were damaged."""

    seq: int
    started: float
    restored: tuple[str, ...]
    lost: int = 0


@dataclass(frozen=True)
class Incomplete:
    """A transaction that began (BEGIN record) but never committed."""

    seq: int
    started: float
    undo: tuple[Record, ...]


def scan(buf: memoryview, sb: Superblock, committed_seq: int) -> Incomplete | None:
    """The incomplete transaction recorded in the undo area, if any."""
    seq = committed_seq + 1
    begin = Record.unpack(buf[sb.record_off : sb.record_off + RECORD_BYTES])
    if begin is None or begin.kind != Record.BEGIN or begin.seq != seq:
        return None
    undo = []
    for index in range(1, sb.record_size // RECORD_BYTES):
        at = sb.record_off + index * RECORD_BYTES
        record = Record.unpack(buf[at : at + RECORD_BYTES])
        if record is None or record.kind != Record.UNDO or record.seq != seq:
            break  # the first torn, stale or empty record ends the log
        undo.append(record)
    return Incomplete(seq, begin.time, tuple(undo))


def restore(
    buf: memoryview,
    meta: Meta,
    undo: tuple[Record, ...],
    path: object,
) -> list[str]:
    """Copy saved bytes back over every block the transaction overwrote; return restored names.

    The caller makes the restored bytes durable before it commits anything over them.

    Each saved copy is checked against the committed checksum before it is used, and a block that
    already matches its committed checksum is left alone. Anything else is damage: refuse.
    """
    by_offset = {e.offset: (name, e) for name, e in meta.vars.items() if e.has_block}
    restored = []
    for record in undo:
        found = by_offset.get(record.target)
        if found is None or found[1].nbytes != record.nbytes or record.saved + record.nbytes > meta.size:
            raise CorruptShelfError(
                f"{path}: an undo record points at a block ({record.target}+{record.nbytes}) that "
                "the committed metadata does not own; the file is damaged. Restore it from a copy."
            )
        name, entry = found
        target = buf[record.target : record.target + record.nbytes]
        if xxhash.xxh3_64_intdigest(target) == entry.digest:
            continue
        saved = buf[record.saved : record.saved + record.nbytes]
        if xxhash.xxh3_64_intdigest(saved) != entry.digest:
            raise CorruptShelfError(
                f"{path}: variable {name!r} was being changed by an interrupted transaction and its "
                "undo copy is damaged, so its committed value cannot be restored. Restore the file "
                "from a copy."
            )
        target[:] = saved
        restored.append(name)
        faults.reached("shelf_mid_recovery")
    return restored
