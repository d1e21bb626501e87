"""The arena file's fixed binary layout: superblock, undo-record area, two metadata slots, data.

::

    [0, 4 KiB)            superblock: magic, format version, where each region starts, checksum
    [4 KiB, +64 KiB)      undo records of the transaction in progress (64 bytes each)
    slot 0, slot 1        the metadata (JSON: variables, allocation, last transaction), ping-pong
    [data_start, size)    variable blocks, 64-byte aligned

A loop (:class:`LoopLayout`) adds, in data blocks named by the metadata, a spare block per array and
a records block: two ping-pong slots for its binary commit records.

Everything is little-endian and checksummed with xxh3-64. The superblock is written once, when the
file is created; the arena's size lives in the metadata so that growing it is an ordinary commit.
"""

from __future__ import annotations

import struct
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from json.encoder import encode_basestring_ascii as _json_str
from typing import Any

import xxhash

from crashsafe.shelf.errors import CorruptShelfError, NotAShelfError

__all__ = [
    "ALIGN",
    "FORMAT_VERSION",
    "LOOP_ABORTED_MAGIC",
    "LOOP_BEGUN",
    "LOOP_BEGUN_MAGIC",
    "LOOP_LIMIT",
    "LOOP_MAGIC",
    "META_HEADER",
    "PAGE",
    "RECORD_BYTES",
    "LoopLayout",
    "Record",
    "Superblock",
    "decode_meta_slot",
    "encode_meta_slot",
    "new_superblock",
    "pack_record",
]

MAGIC = b"CRASHSAFE-SHELF\x00"
FORMAT_VERSION = 1
PAGE = 4096
ALIGN = 64
RECORD_AREA = 64 * 1024
RECORD_BYTES = 64
META_MAGIC = b"CSMETA01"
META_HEADER = 32
RECORD_MAGIC = b"CSTX"
LOOP_MAGIC = b"CSLOOP01"
LOOP_BEGUN = struct.Struct("<8sQd")  # b"CSLOOPBG", seq, time: the loop iteration in progress
LOOP_BEGUN_MAGIC = b"CSLOOPBG"
LOOP_ABORTED_MAGIC = b"CSLOOPAB"  # in place of LOOP_BEGUN_MAGIC: the iteration was aborted
LOOP_LIMIT = 64  # variables per loop: a commit record's bitmask of changed variables is one u64

_SUPER = struct.Struct("<16sII5Q16sd")  # magic, version, reserved, 5 offsets/sizes, uuid, created
_META = struct.Struct("<8sQQ")  # magic, seq, payload length (+ u64 checksum after)
_RECORD = struct.Struct("<4sIQQQQd")  # magic, kind, seq, target, nbytes, saved, time (+ u64 checksum)
_U64 = struct.Struct("<Q")


def _xxh(*parts: bytes | memoryview) -> int:
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.intdigest()


@dataclass(frozen=True)
class Superblock:
    """Where the regions of an arena file are; immutable after creation."""

    version: int
    record_off: int
    record_size: int
    slot_off: int
    slot_size: int
    data_start: int
    uuid: bytes
    created: float

    def slot(self, index: int) -> int:
        """Byte offset of metadata slot 0 or 1."""
        return self.slot_off + index * self.slot_size

    def pack(self) -> bytes:
        body = _SUPER.pack(MAGIC, self.version, 0, self.record_off, self.record_size, self.slot_off,
                           self.slot_size, self.data_start, self.uuid, self.created)
        return body + _U64.pack(_xxh(body))

    @classmethod
    def unpack(cls, raw: bytes, path: object) -> Superblock:
        """Parse and check the first page; refuse foreign or damaged files with a clear error."""
        if len(raw) < _SUPER.size + 8:
            raise NotAShelfError(
                f"{path} is not a crashsafe shelf: it is only {len(raw)} bytes long. Choose another "
                "path, or delete the file if it is a leftover."
            )
        fields = _SUPER.unpack_from(raw)
        if fields[0] != MAGIC:
            raise NotAShelfError(
                f"{path} is not a crashsafe shelf (its first bytes are {raw[:16]!r}). Refusing to "
                "touch it: choose another path for the shelf."
            )
        (checksum,) = _U64.unpack_from(raw, _SUPER.size)
        if checksum != _xxh(raw[: _SUPER.size]):
            raise CorruptShelfError(
                f"{path}: the shelf's superblock fails its checksum; the file is damaged. Restore it "
                "from a copy; crashsafe will not guess its layout."
            )
        sb = cls(version=fields[1], record_off=fields[3], record_size=fields[4], slot_off=fields[5],
                 slot_size=fields[6], data_start=fields[7], uuid=fields[8], created=fields[9])
        if sb.version > FORMAT_VERSION:
            raise NotAShelfError(
                f"{path} uses shelf format {sb.version}, newer than this crashsafe understands "
                f"({FORMAT_VERSION}). Upgrade crashsafe to open it."
            )
        ordered = (sb.record_off >= PAGE and sb.record_off + sb.record_size <= sb.slot_off
                   and sb.slot(2) <= sb.data_start and sb.slot_size > META_HEADER
                   and sb.record_size % RECORD_BYTES == 0 and sb.data_start % PAGE == 0)
        if not ordered:
            raise CorruptShelfError(f"{path}: the shelf's superblock describes an impossible layout")
        return sb


def new_superblock(size: int) -> Superblock:
    """Layout for a new arena of ``size`` bytes: metadata slots scale with it (64 KiB..4 MiB)."""
    slot_size = min(4 << 20, max(64 << 10, (size // 256) // PAGE * PAGE))
    record_off = PAGE
    slot_off = record_off + RECORD_AREA
    data_start = slot_off + 2 * slot_size
    return Superblock(FORMAT_VERSION, record_off, RECORD_AREA, slot_off, slot_size, data_start,
                      uuid.uuid4().bytes, time.time())


def encode_meta_slot(seq: int, payload: bytes) -> bytes:
    """Header (magic, seq, length, checksum over header and payload) followed by the payload."""
    head = _META.pack(META_MAGIC, seq, len(payload))
    return head + _U64.pack(xxhash.xxh3_64_intdigest(head + payload)) + payload


def decode_meta_slot(raw: bytes | memoryview, slot_size: int) -> tuple[int, bytes] | None:
    """(seq, payload) of a valid slot; None if the slot is empty, torn or damaged."""
    if len(raw) < META_HEADER:
        return None
    magic, seq, length = _META.unpack_from(raw)
    if magic != META_MAGIC or length > slot_size - META_HEADER:
        return None
    (checksum,) = _U64.unpack_from(raw, _META.size)
    payload = bytes(raw[META_HEADER : META_HEADER + length])
    if checksum != _xxh(bytes(raw[: _META.size]), payload):
        return None
    return seq, payload


_RECORD_PAD = bytes(RECORD_BYTES - _RECORD.size - _U64.size)


def pack_record(kind: int, seq: int, target: int = 0, nbytes: int = 0, saved: int = 0,
                when: float = 0.0) -> bytes:
    """The 64 bytes of a :class:`Record` (without building one: a BEGIN is written per transaction)."""
    body = _RECORD.pack(RECORD_MAGIC, kind, seq, target, nbytes, saved, when)
    return body + _U64.pack(xxhash.xxh3_64_intdigest(body)) + _RECORD_PAD


@dataclass(frozen=True)
class Record:
    """One undo record. Record 0 of a transaction is its BEGIN; the others save one block each.

    ``target``/``nbytes`` is the block that may be overwritten in place; ``saved`` is where its
    committed bytes were copied before that (a block that is free in the committed metadata).
    """

    BEGIN = 0
    UNDO = 1

    kind: int
    seq: int
    target: int = 0
    nbytes: int = 0
    saved: int = 0
    time: float = 0.0

    def pack(self) -> bytes:
        return pack_record(self.kind, self.seq, self.target, self.nbytes, self.saved, self.time)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> Record | None:
        """The record in ``raw``, or None if it is empty, torn or damaged."""
        body = bytes(raw[: _RECORD.size])
        magic, kind, seq, target, nbytes, saved, when = _RECORD.unpack(body)
        if magic != RECORD_MAGIC or kind not in (cls.BEGIN, cls.UNDO):
            return None
        if _U64.unpack_from(raw, _RECORD.size)[0] != _xxh(body):
            return None
        return cls(kind, seq, target, nbytes, saved, when)


_SCALAR_CODES = {"bool": "?", "int": "q", "float": "d"}  # the scalar types a loop records


@dataclass(frozen=True)
class LoopLayout:
    """Where a loop's state lives (see :class:`crashsafe.shelf.loop.Loop`).

    ``arrays`` are ``(name, block 0, block 1)``: the variable's committed block is one of the two,
    the other is its spare; ``scalars`` are ``(name, type)`` with type ``bool``, ``int`` or
    ``float``; ``records`` is a block of two record slots. ``id`` is the transaction that created
    the loop: records carry it, so bytes left by an earlier loop never pass for this one's.

    A record slot holds ``magic, seq, id, time``, then ``(block index, xxh3, version)`` per array,
    ``(value, version)`` per scalar, a u64 bitmask of the variables the commit changed (arrays
    first), and an xxh3 of all that. The records block starts with a line where ``begin`` marks
    the iteration in progress (:data:`LOOP_BEGUN`: magic, seq, time, then an xxh3 of those and the
    loop's id) and ``abort`` marks it aborted (another magic), then the two slots.
    """

    id: int
    arrays: tuple[tuple[str, int, int], ...]
    scalars: tuple[tuple[str, str], ...]
    records: int

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.arrays) + tuple(name for name, _ in self.scalars)

    @cached_property
    def record(self) -> struct.Struct:
        """The fields of a record, before its checksum."""
        scalars = "".join(_SCALAR_CODES[kind] + "Q" for _, kind in self.scalars)
        return struct.Struct("<8sQQd" + "QQQ" * len(self.arrays) + scalars + "Q")

    @cached_property
    def slot_bytes(self) -> int:
        return -(-(self.record.size + _U64.size) // ALIGN) * ALIGN

    @property
    def records_bytes(self) -> int:
        return ALIGN + 2 * self.slot_bytes

    def blocks(self, entries: Mapping[str, Any]) -> list[tuple[int, int]]:
        """``(offset, bytes)`` of the blocks the loop owns besides its variables': each array's
        spare (the block its entry in ``entries`` does not point at) and the records block."""
        spares = []
        for name, b0, b1 in self.arrays:
            entry = entries[name]
            spares.append((b1 if entry.offset == b0 else b0, entry.nbytes))
        return [*spares, (self.records, self.records_bytes)]

    def slot(self, seq: int) -> int:
        """Offset of the slot record ``seq`` goes to (never the one of record ``seq - 1``)."""
        return self.records + ALIGN + (seq & 1) * self.slot_bytes

    @cached_property
    def json(self) -> str:
        arrays = ",".join(f"[{_json_str(n)},{b0},{b1}]" for n, b0, b1 in self.arrays)
        scalars = ",".join(f'[{_json_str(n)},"{kind}"]' for n, kind in self.scalars)
        return f'{{"id":{self.id},"arrays":[{arrays}],"scalars":[{scalars}],"records":{self.records}}}'

    @classmethod
    def from_json(cls, raw: Any) -> LoopLayout | None:
        """The layout in decoded JSON ``raw``, or None if it is malformed (the caller refuses it)."""
        if not isinstance(raw, dict) or set(raw) != {"id", "arrays", "scalars", "records"}:
            return None
        ident, arrays, scalars, records = raw["id"], raw["arrays"], raw["scalars"], raw["records"]
        if not (_u64(ident) and _u64(records) and isinstance(arrays, list) and isinstance(scalars, list)):
            return None
        if not all(isinstance(a, list) and len(a) == 3 and isinstance(a[0], str) and a[0]
                   and _u64(a[1]) and _u64(a[2]) and a[1] != a[2] for a in arrays):
            return None
        if not all(isinstance(s, list) and len(s) == 2 and isinstance(s[0], str) and s[0]
                   and s[1] in _SCALAR_CODES for s in scalars):
            return None
        layout = cls(ident, tuple((a[0], a[1], a[2]) for a in arrays), tuple((s[0], s[1]) for s in scalars),
                     records)
        names = layout.names
        if not names or len(names) > LOOP_LIMIT or len(set(names)) != len(names):
            return None
        return layout


def _u64(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 64


