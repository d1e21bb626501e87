"""The shelf's metadata: every variable's kind, type, shape, block and checksum, as validated JSON.

The metadata is the allocator's only record (a block is used iff a variable points at it), so one
atomic metadata switch commits data, allocation and versions together. Loaded metadata is
untrusted input: every field is type- and range-checked before any byte is used.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _json_str
from typing import Any, Literal, NamedTuple, TypeGuard

import numpy as np

from crashsafe.format.dtypes import DTYPES
from crashsafe.shelf.errors import CorruptShelfError
from crashsafe.shelf.layout import META_HEADER, LoopLayout, Superblock, decode_meta_slot

__all__ = [
    "DTYPE_NAMES", "NUMERIC_DTYPES", "Entry", "Kind", "Meta", "MetaEncoder", "commit_record", "decode_meta",
    "encode_meta", "read_newest", "scalar_ok", "scalar_type",
]

Kind = Literal["array", "str", "bytes", "scalar"]
_BLOCK_KINDS = ("array", "str", "bytes")
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode  # ASCII; NaN/inf as JSON's extension
_SCALAR_TYPES = ("bool", "int", "float", "complex", "none")
# numpy dtypes a shelf variable may have (the torch-only names of DTYPES are not numpy types)
NUMERIC_DTYPES = {name: dt for name, dt in DTYPES.items() if dt.name == name}
DTYPE_NAMES = {dt: name for name, dt in NUMERIC_DTYPES.items()}


class Entry(NamedTuple):
    """One variable. Block kinds own ``nbytes`` at ``offset``; scalars live in the metadata."""

    kind: Kind
    version: int
    dtype: str = ""
    shape: tuple[int, ...] = ()
    offset: int = 0
    nbytes: int = 0
    digest: int = 0
    value: Any = None

    @property
    def has_block(self) -> bool:
        return self.kind != "scalar"

    def to_json(self) -> str:
        """Compact JSON text: ``[kind, version, dtype, shape, offset, nbytes, "xxh3 hex"]`` for blocks,
        ``["scalar", version, type, value]`` for scalars (complex as ``[real, imag]``); formatted
        directly, exactly as ``json.dumps`` would (an entry is encoded at every change)."""
        if self.kind != "scalar":
            shape = ",".join(map(str, self.shape))
            return (f'["{self.kind}",{self.version},"{self.dtype}",[{shape}],{self.offset},{self.nbytes},'
                    f'"{self.digest:016x}"]')
        return f'["scalar",{self.version},"{scalar_type(self.value)}",{_scalar_json(self.value)}]'


@dataclass
class Meta:
    """Committed state of a shelf: transaction number, arena size, variables, last events, and
    the layout of its loop if it has one (format 2; a shelf without a loop is written as format 1)."""

    seq: int
    size: int
    vars: dict[str, Entry] = field(default_factory=dict)
    tx: dict[str, Any] = field(default_factory=dict)
    rollback: dict[str, Any] | None = None
    loop: LoopLayout | None = None


def scalar_type(value: object) -> str:
    """The type name the metadata records for a scalar (``bool``, ``int``, ``float``, ``none``...)."""
    if value is None:
        return "none"
    return type(value).__name__


def _float_json(value: float) -> str:
    """A float as ``json.dumps`` writes it (NaN and infinities use JSON's extension)."""
    if value != value:
        return "NaN"
    if value == math.inf:
        return "Infinity"
    if value == -math.inf:
        return "-Infinity"
    return float.__repr__(value)


def _scalar_json(value: bool | int | float | complex | None) -> str:
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, complex):
        return f"[{_float_json(value.real)},{_float_json(value.imag)}]"
    if isinstance(value, float):
        return _float_json(value)
    return int.__repr__(value)


def commit_record(seq: int, when: float, changed: list[str], deleted: list[str]) -> dict[str, Any]:
    """A commit's record: its number and time, and the variables it changed and deleted."""
    return {"seq": seq, "time": when, "changed": changed, "deleted": deleted}


class MetaEncoder:
    """Compact JSON of metadata, commit after commit: the bytes ``json.dumps(doc, separators=(",",
    ":"))`` gives (ASCII; floats round-trip exactly; NaN/inf as JSON's extension), made cheaply.

    A variable the commit did not change keeps its :class:`Entry` object, so its JSON from the
    previous commit is reused: encoding costs one string join over all variables plus the JSON of
    the changed ones, not a full ``json.dumps`` of the table.
    """

    def __init__(self) -> None:
        self._done: dict[str, tuple[Entry, str, str]] = {}  # name -> (entry, JSON key, "key:entry")
        self._rollback: tuple[dict[str, Any] | None, str] = (None, "null")

    def encode(self, meta: Meta, committed: bool = False) -> bytes:
        """The JSON of ``meta``; ``committed`` says its ``tx`` is a :func:`commit_record` (whose
        changed variables are in ``meta``: their cached JSON keys are reused)."""
        done, fresh = self._done, {}
        for name, entry in meta.vars.items():
            hit = done.get(name)
            if hit is None:
                key = _json_str(name)
                fresh[name] = (entry, key, f"{key}:{entry.to_json()}")
            elif hit[0] is entry:
                fresh[name] = hit
            else:
                fresh[name] = (entry, hit[1], f"{hit[1]}:{entry.to_json()}")
        self._done = fresh
        if self._rollback[0] is not meta.rollback:
            self._rollback = (meta.rollback, _ENCODE(meta.rollback))
        body = ",".join([part for _, _, part in fresh.values()])
        tx_json = _commit_json(meta.tx, fresh) if committed else _ENCODE(meta.tx)
        if meta.loop is None:
            return (f'{{"format":1,"size":{meta.size},"tx":{tx_json},"rollback":{self._rollback[1]},'
                    f'"vars":{{{body}}}}}').encode()
        return (f'{{"format":2,"size":{meta.size},"tx":{tx_json},"rollback":{self._rollback[1]},'
                f'"vars":{{{body}}},"loop":{meta.loop.json}}}').encode()


def _commit_json(tx: dict[str, Any], keys: dict[str, tuple[Entry, str, str]]) -> str:
    """JSON of a commit record, formatted directly (the changed names' JSON is the encoder's cached
    keys): the text ``json.dumps`` gives (a commit's time is a finite float)."""
    changed = ",".join([keys[name][1] for name in tx["changed"]])
    deleted = ",".join(map(_json_str, tx["deleted"]))
    return (f'{{"seq":{tx["seq"]},"time":{float.__repr__(tx["time"])},"changed":[{changed}],'
            f'"deleted":[{deleted}]}}')


def encode_meta(meta: Meta) -> bytes:
    """Compact JSON of ``meta`` (one-off; a shelf keeps a :class:`MetaEncoder`)."""
    return MetaEncoder().encode(meta)


def _fail(path: object, what: str) -> CorruptShelfError:
    return CorruptShelfError(
        f"{path}: the shelf's metadata is invalid ({what}) although its checksum matches; the "
        "file was forged or written by a broken tool. Refusing to use it."
    )


def _int(value: object, low: int = 0) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def decode_meta(payload: bytes, seq: int, data_start: int, path: object) -> Meta:
    """Parse and validate metadata; any inconsistency raises :class:`CorruptShelfError`."""
    try:
        doc = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _fail(path, f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") not in (1, 2) or ("loop" in doc) != (doc["format"] > 1):
        raise _fail(path, "unknown metadata format")
    size, raw_vars = doc.get("size"), doc.get("vars")
    if not _int(size, data_start) or not isinstance(raw_vars, dict):
        raise _fail(path, "size or variable table missing")
    tx, rollback = doc.get("tx", {}), doc.get("rollback")
    if not isinstance(tx, dict) or not (rollback is None or isinstance(rollback, dict)):
        raise _fail(path, "transaction records malformed")
    entries = {name: _decode_entry(name, raw, path) for name, raw in raw_vars.items()}
    loop = None
    if "loop" in doc:
        loop = LoopLayout.from_json(doc["loop"])
        if loop is None:
            raise _fail(path, "loop layout malformed")
    _check_blocks(entries, _loop_blocks(loop, entries, path), data_start, size, path)
    return Meta(seq, size, entries, tx, rollback, loop)


def _decode_entry(name: str, raw: object, path: object) -> Entry:
    if not name or not isinstance(raw, list) or len(raw) < 4 or not _int(raw[1], 1):
        raise _fail(path, f"variable {name!r} malformed")
    kind, version = raw[0], raw[1]
    if kind == "scalar" and len(raw) == 4:
        return Entry("scalar", version, value=_decode_scalar(name, raw[2], raw[3], path))
    if kind not in _BLOCK_KINDS or len(raw) != 7:
        raise _fail(path, f"variable {name!r} has unknown kind {kind!r}")
    _, _, dtype, shape, offset, nbytes, digest = raw
    if not _int(offset) or not _int(nbytes) or not isinstance(digest, str) or len(digest) != 16:
        raise _fail(path, f"variable {name!r} has a malformed block")
    try:
        digest_int = int(digest, 16)
    except ValueError:
        raise _fail(path, f"variable {name!r} has a malformed checksum") from None
    if kind != "array":
        if dtype != "" or shape != []:
            raise _fail(path, f"{kind} {name!r} has a dtype or shape")
        return Entry(kind, version, offset=offset, nbytes=nbytes, digest=digest_int)
    if dtype not in NUMERIC_DTYPES or not isinstance(shape, list) or not all(_int(s) for s in shape):
        raise _fail(path, f"array {name!r} has a bad dtype or shape")
    if math.prod(shape) * NUMERIC_DTYPES[dtype].itemsize != nbytes:
        raise _fail(path, f"array {name!r}: {dtype}{shape} does not take {nbytes} bytes")
    return Entry("array", version, dtype, tuple(shape), offset, nbytes, digest_int)


def _decode_scalar(name: str, kind: object, value: Any, path: object) -> Any:
    if kind == "complex" and isinstance(value, list) and len(value) == 2 and all(
        isinstance(v, float) for v in value
    ):
        return complex(value[0], value[1])
    ok = {
        "none": value is None,
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, float),
    }.get(kind if isinstance(kind, str) else "", False)
    if not ok:
        raise _fail(path, f"scalar {name!r} malformed")
    return value


def _loop_blocks(loop: LoopLayout | None, entries: dict[str, Entry],
                 path: object) -> list[tuple[int, int, str]]:
    """The blocks ``loop`` owns besides its variables' (spares, records), after checking that its
    variables are on the shelf with the kinds and blocks it names."""
    if loop is None:
        return []
    for name, b0, b1 in loop.arrays:
        entry = entries.get(name)
        if entry is None or entry.kind != "array" or entry.offset not in (b0, b1):
            raise _fail(path, f"loop array {name!r} is not an array in one of its two blocks")
    for name, kind in loop.scalars:
        entry = entries.get(name)
        if entry is None or entry.kind != "scalar" or scalar_type(entry.value) != kind:
            raise _fail(path, f"loop scalar {name!r} is not a {kind} scalar")
    return [(offset, nbytes, "the loop's own") for offset, nbytes in loop.blocks(entries)]


def _check_blocks(entries: dict[str, Entry], extra: list[tuple[int, int, str]], data_start: int, size: int,
                  path: object) -> None:
    blocks = sorted([*((e.offset, e.nbytes, repr(n)) for n, e in entries.items() if e.has_block), *extra])
    end = data_start
    for offset, nbytes, name in blocks:
        if offset < end or offset + nbytes > size:
            raise _fail(path, f"block of {name} at {offset}+{nbytes} overlaps or leaves the arena")
        end = offset + max(nbytes, 1)


def scalar_ok(value: object) -> bool:
    """Python values the shelf keeps in its metadata."""
    if isinstance(value, np.generic):
        return False
    return value is None or isinstance(value, (bool, int, float, complex))


def read_newest(buf: memoryview, sb: Superblock, path: object) -> tuple[Meta, str]:
    """The newest valid metadata slot, decoded, and the state of the other one.

    The other slot is described as ``"ok (seq N)"``, ``"empty"`` (never written) or ``"damaged"``.
    """
    found: list[tuple[int, bytes, int]] = []
    states = []
    for index in (0, 1):
        raw = buf[sb.slot(index) : sb.slot(index) + sb.slot_size]
        slot = decode_meta_slot(raw, sb.slot_size)
        if slot is not None:
            found.append((*slot, index))
        states.append("empty" if slot is None and not any(raw[:META_HEADER]) else
                      "damaged" if slot is None else f"ok (seq {slot[0]})")
    if not found:
        raise CorruptShelfError(
            f"{path}: both copies of the shelf's metadata fail their checksums; the file is "
            "damaged. Restore it from a copy; crashsafe will not guess which bytes are valid."
        )
    seq, payload, index = max(found)
    return decode_meta(payload, seq, sb.data_start, path), states[1 - index]
