"""A loop's commit records (see :class:`~crashsafe.shelf.loop.Loop`): the record type, reading the
newest valid one from a records block, and applying one to the metadata. Nothing here writes.

The committed state of a shelf with a loop is its newest metadata slot with the newest valid record
of the loop applied, if that record is newer (:func:`read_committed`). A begin mark in the records
block with the number after the committed state is an iteration a crash interrupted
(:func:`interrupted`). A mark (begun or aborted, its checksum right) of a later iteration proves the
commits before it, which damaged records lost (:func:`lost`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import xxhash

from crashsafe.shelf.errors import CorruptShelfError, ShelfError
from crashsafe.shelf.layout import (
    LOOP_ABORTED_MAGIC,
    LOOP_BEGUN,
    LOOP_BEGUN_MAGIC,
    LOOP_LIMIT,
    LOOP_MAGIC,
    LoopLayout,
    Superblock,
)
from crashsafe.shelf.meta import Entry, Meta, commit_record, read_newest, scalar_type
from crashsafe.shelf.recovery import Incomplete

__all__ = [
    "CHECKSUM",
    "XXH3",
    "ArrayFields",
    "LoopRecord",
    "RecordFields",
    "ScalarFields",
    "fold",
    "intact",
    "interrupted",
    "is_loop_scalar",
    "loop_variables",
    "lost",
    "mark",
    "read_committed",
    "record_fields",
]

_SCALAR_TYPES: dict[str, type] = {"bool": bool, "int": int, "float": float}  # a record's scalar kinds
CHECKSUM = struct.Struct("<Q")  # the xxh3 that follows a record's fields
XXH3: Callable[[Any], int] = xxhash.xxh3_64_intdigest  # (ndarrays are buffers)


class ArrayFields(NamedTuple):
    """Where an array's fields are in its loop's records, and its bit in their ``mask``."""

    name: str
    bit: int
    block: int  # which of the array's two blocks is current: 0 or 1
    digest: int  # the xxh3 of its bytes
    version: int


class ScalarFields(NamedTuple):
    """Where a scalar's fields are in its loop's records, its type, and its bit in their ``mask``."""

    name: str
    kind: type
    bit: int
    value: int
    version: int


class RecordFields(NamedTuple):
    """Where the fields of a loop's records are: each array's, each scalar's, and ``mask``."""

    arrays: tuple[ArrayFields, ...]
    scalars: tuple[ScalarFields, ...]
    mask: int


def record_fields(layout: LoopLayout) -> RecordFields:
    """The positions of the fields in the records of ``layout``'s loop (after magic, seq, id, time:
    three per array, two per scalar, then the mask)."""
    arrays = tuple(ArrayFields(name, 1 << i, 4 + 3 * i, 5 + 3 * i, 6 + 3 * i)
                   for i, (name, _, _) in enumerate(layout.arrays))
    at, n = 4 + 3 * len(arrays), len(arrays)
    scalars = tuple(ScalarFields(name, _SCALAR_TYPES[kind], 1 << (n + j), at + 2 * j, at + 2 * j + 1)
                    for j, (name, kind) in enumerate(layout.scalars))
    return RecordFields(arrays, scalars, at + 2 * len(scalars))


class LoopRecord(list[Any]):
    """One loop commit, as its record slot holds it: the fields the layout's struct packs, in
    order: ``magic, seq, id, time``; per array which of its two blocks is current, its xxh3 and
    version; per scalar its value and version; ``mask``, the variables the commit changed (bit i:
    the layout's i-th name, arrays first). :func:`record_fields` says where a variable's fields are.

    A record is a list so that a commit is one copy and one ``pack``: a loop commits in
    microseconds. Once committed, a record is not changed.
    """

    __slots__ = ()

    SEQ, TIME, MASK = 1, 3, -1  # (the positions of these fields)

    @property
    def seq(self) -> int:
        return int(self[LoopRecord.SEQ])

    @property
    def time(self) -> float:
        return float(self[LoopRecord.TIME])

    @classmethod
    def of(cls, layout: LoopLayout, meta: Meta) -> LoopRecord:
        """The record describing the loop's variables as ``meta`` commits them (changing none)."""
        entries = meta.vars
        fields: list[Any] = [LOOP_MAGIC, meta.seq, layout.id, float(meta.tx.get("time", 0.0))]
        for name, b0, _ in layout.arrays:
            entry = entries[name]
            fields += (0 if entry.offset == b0 else 1, entry.digest, entry.version)
        for name, _ in layout.scalars:
            fields += (entries[name].value, entries[name].version)
        fields.append(0)
        return cls(fields)

    @classmethod
    def unpack(cls, buf: memoryview, layout: LoopLayout, at: int, path: object) -> LoopRecord | None:
        """The record in the slot at ``at``, or None if the slot is empty, torn, damaged or not this
        loop's; a record whose checksum matches but whose fields are impossible is refused."""
        packing = layout.record
        if at + packing.size + CHECKSUM.size > len(buf):
            return None
        record = cls(packing.unpack_from(buf, at))
        if record[0] != LOOP_MAGIC or record[2] != layout.id:
            return None
        if CHECKSUM.unpack_from(buf, at + packing.size)[0] != XXH3(buf[at : at + packing.size]):
            return None
        arrays, scalars, _ = record_fields(layout)
        for scalar in scalars:
            record[scalar.value] = scalar.kind(record[scalar.value])
        versions = [*(record[a.version] for a in arrays), *(record[s.version] for s in scalars)]
        if any(record[a.block] not in (0, 1) for a in arrays) or min(versions, default=1) < 1:
            raise CorruptShelfError(
                f"{path}: a loop record of the shelf names a block or version that cannot exist although "
                "its checksum matches; the file was forged or written by a broken tool. Refusing to use it."
            )
        return record


def fold(meta: Meta, record: LoopRecord) -> Meta:
    """``meta`` with loop commit ``record`` applied: the committed state after it."""
    layout = meta.loop
    assert layout is not None
    variables = dict(meta.vars)
    changed = []
    arrays, scalars, _ = record_fields(layout)
    mask = record[LoopRecord.MASK]
    for (_, *blocks), a in zip(layout.arrays, arrays, strict=True):
        entry = variables[a.name]
        variables[a.name] = entry._replace(version=record[a.version], offset=blocks[record[a.block]],
                                           digest=record[a.digest])
        if mask & a.bit:
            changed.append(a.name)
    for s in scalars:
        variables[s.name] = Entry("scalar", record[s.version], value=record[s.value])
        if mask & s.bit:
            changed.append(s.name)
    changed.sort()
    info = commit_record(record.seq, record.time, changed, [])
    return Meta(record.seq, meta.size, variables, info, meta.rollback, layout)


def read_committed(buf: memoryview, sb: Superblock, path: object) -> tuple[Meta, str]:
    """The committed state: the newest metadata slot (:func:`read_newest`) with the newest valid
    record of its loop applied, if that is newer."""
    meta, spare = read_newest(buf, sb, path)
    layout = meta.loop
    if layout is not None:
        found = [r for r in (LoopRecord.unpack(buf, layout, layout.slot(n), path) for n in (0, 1))
                 if r is not None and r.seq > meta.seq]
        if found:
            meta = fold(meta, max(found, key=lambda r: r.seq))
    return meta, spare


def mark(layout: LoopLayout, magic: bytes, seq: int, when: float) -> bytes:
    """The loop's begin line for iteration ``seq``, begun (:data:`LOOP_BEGUN_MAGIC`) or aborted
    (:data:`LOOP_ABORTED_MAGIC`) at ``when``, with a checksum of it and the loop's id: a mark
    damaged, or left by another loop in the same bytes, never counts as proof of a commit."""
    line = LOOP_BEGUN.pack(magic, seq, when)
    return line + CHECKSUM.pack(XXH3(line + CHECKSUM.pack(layout.id)))


def lost(buf: memoryview, meta: Meta) -> tuple[int, int, float] | None:
    """``(first, last, when)``: the loop commits ``first..last`` that the begin line proves (an
    iteration begins only after the one before it committed) but the committed state ``meta`` lacks:
    their records were damaged. None if the line proves none (or is damaged, or from before marks
    carried a checksum)."""
    layout = meta.loop
    if layout is None:
        return None
    at = layout.records
    line = bytes(buf[at : at + LOOP_BEGUN.size + CHECKSUM.size])
    magic, seq, when = LOOP_BEGUN.unpack_from(line)
    if magic not in (LOOP_BEGUN_MAGIC, LOOP_ABORTED_MAGIC) or line != mark(layout, magic, seq, when):
        return None
    return (meta.seq + 1, seq - 1, when) if seq - 1 > meta.seq else None


def interrupted(buf: memoryview, meta: Meta) -> Incomplete | None:
    """The loop iteration a crash interrupted (begun after the committed state ``meta``), if any."""
    if meta.loop is None:
        return None
    magic, seq, when = LOOP_BEGUN.unpack_from(buf, meta.loop.records)
    return Incomplete(seq, when, ()) if magic == LOOP_BEGUN_MAGIC and seq == meta.seq + 1 else None


def loop_variables(variables: Mapping[str, Entry],
                   names: Sequence[str]) -> tuple[list[tuple[str, Entry]], list[tuple[str, str]]]:
    """The arrays ``(name, entry)`` and scalars ``(name, kind)`` a loop over ``names`` would hold;
    refuses a name that is missing or of a kind a loop cannot commit, and too many names."""
    arrays, scalars = [], []
    for name in names:
        entry = variables.get(name)
        if entry is None:
            raise ShelfError(f"loop(): there is no variable {name!r} on the shelf; assign its first "
                             f"value (shelf[{name!r}] = ...) before starting the loop")
        if entry.kind == "array":
            arrays.append((name, entry))
        elif entry.kind == "scalar" and is_loop_scalar(entry.value):
            scalars.append((name, scalar_type(entry.value)))
        else:
            what = f"a {scalar_type(entry.value)} scalar" if entry.kind == "scalar" else f"a {entry.kind}"
            raise ShelfError(f"loop(): {name!r} is {what}; a loop commits numeric arrays and bool, "
                             "int (64-bit) and float scalars. Leave it out of the loop and change it in "
                             "a transaction")
    if len(names) > LOOP_LIMIT:
        raise ShelfError(f"loop(): a loop has at most {LOOP_LIMIT} variables, got {len(names)}")
    return arrays, scalars


def is_loop_scalar(value: Any) -> bool:
    """Can a loop commit this scalar (a bool, an int that fits 64 bits, or a float)?"""
    kind = type(value)
    return kind is bool or kind is float or (kind is int and -(1 << 63) <= value < 1 << 63)


def intact(layout: LoopLayout, variables: Mapping[str, Entry]) -> bool:
    """Does ``layout`` still describe ``variables`` (each array in one of its blocks, each scalar of
    its type)? A commit that broke it ends the loop."""
    for name, b0, b1 in layout.arrays:
        entry = variables.get(name)
        if entry is None or entry.kind != "array" or entry.offset not in (b0, b1):
            return False
    for name, kind in layout.scalars:
        entry = variables.get(name)
        if entry is None or entry.kind != "scalar" or type(entry.value) is not _SCALAR_TYPES[kind]:
            return False
    return True
