"""The on-disk manifest: versioned JSON, self-checksummed, validated before any byte is used.

See ``docs/format.md``. A manifest describes one committed step: the state's tree, one entry per
payload (where its bytes live, how they are encoded, their xxh3 checksum) and the data files'
sizes. Nothing in it is ever executed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any

import xxhash

from crashsafe.codecs.registry import get_codec
from crashsafe.errors import CodecError, CorruptCheckpointError, InvalidArgumentError
from crashsafe.format.checks import MAX_INT64, MAX_NDIM, MIN_INT64
from crashsafe.format.checks import bad as _bad
from crashsafe.format.checks import checked_int as _int
from crashsafe.format.checks import member as _member
from crashsafe.format.checks import show as _show
from crashsafe.format.chunks import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, Chunks, chunk_count, combine
from crashsafe.format.dtypes import DTYPES
from crashsafe.format.tree import TreeCheck as _TreeCheck
from crashsafe.format.tree import validate_tree

__all__ = [
    "CHUNKED_VERSION",
    "DISTRIBUTED_VERSION",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "PART_KEY",
    "REFERENCES_VERSION",
    "Manifest",
    "PayloadEntry",
    "base_mark",
    "check_written",
    "checked_step",
    "dumps",
    "loads",
    "validate_file_name",
]

FORMAT_NAME = "crashsafe-checkpoint"
FORMAT_VERSION = 1  # what a single process writes
PART_KEY = "memory.part"  # info of a memory tier's step: "<rank>/<world>", one rank's part of a job's step
DISTRIBUTED_VERSION = 2  # many ranks: per-rank trees, payloads with their writer and shard
CHUNKED_VERSION = 3  # version 2, and raw shards with per-chunk checksums (format/chunks.py)
REFERENCES_VERSION = 4  # either layout, and payloads whose bytes an earlier step holds ("ref")
MAX_RANKS = 65536
MANIFEST_NAME = "manifest.json"
MAX_STEP = MAX_INT64  # steps are int64 everywhere (names, JSON, other tools)
# Parse bounds, checked on the raw bytes before json.loads builds any object (docs/format.md,
# "Limits"). A state of 150k tensors (a MoE model with AdamW) needs 63-71 MiB, 0.53M objects and
# 3.0-3.4M values; loading it takes ~320 MiB. The worst manifest within the bounds takes ~0.8 GiB.
MAX_MANIFEST_BYTES = 96 * 1024 * 1024
MAX_JSON_OBJECTS = 800_000  # count of b"{"
MAX_JSON_VALUES = 4_500_000  # count of b"{", b"[" and b",": every JSON value but the first follows one
LEAF_KINDS = frozenset({"torch", "numpy", "npscalar", "bytes"})
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_HEX64 = re.compile(r"[0-9a-f]{16}")


def checked_step(step: object) -> int:
    """``step`` as an int if a step can have that number (a whole number, numpy's too, from 0 to
    2**63 - 1; not a bool), else InvalidArgumentError (a ValueError): the check of a step to save."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or not 0 <= int(step) <= MAX_STEP:
        raise InvalidArgumentError(
            f"step must be a whole number from 0 to 2**63 - 1 (the training step being saved), got "
            f"{step!r}; nothing was saved"
        )
    return int(step)


def base_mark(base: int) -> str:
    """The ``info`` key under which a step records the creation time of ``base``, a step its delta
    payloads are encoded against: a reader decodes them only against that very save of ``base``.
    (In ``info``, so that every crashsafe, older ones too, reads the manifest.)"""
    return f"base_created.{base}"


@dataclass(frozen=True)
class PayloadEntry:
    """Where one array's encoded bytes live and how to turn them back into the array."""

    path: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int
    xxh3: str
    codec: dict[str, Any]
    base: int | None = None  # a delta codec's payload: the earlier step it is a delta against
    rank: int | None = None  # a distributed step's payload: the rank that wrote it
    shard: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # (global shape, offset) of a shard
    chunks: Chunks | None = None  # a raw shard's per-chunk checksums (its xxh3 is theirs combined)
    ref: int | None = None  # a reference: the earlier step whose data file holds these very bytes

    @property
    def raw_nbytes(self) -> int:
        """Size of the decoded array in bytes."""
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def to_json(self) -> dict[str, Any]:
        body = {
            "path": self.path,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "file": self.file,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "xxh3": self.xxh3,
            "codec": self.codec,
        }
        if self.base is not None:
            body["base"] = self.base
        if self.rank is not None:
            body["rank"] = self.rank
        if self.shard is not None:
            body["shard"] = {"global": list(self.shard[0]), "offset": list(self.shard[1])}
        if self.chunks is not None:
            body["chunks"] = {"bytes": self.chunks.size, "xxh3": list(self.chunks.xxh3)}
        if self.ref is not None:
            body["ref"] = self.ref
        return body


@dataclass(frozen=True)
class Manifest:
    """Everything needed to read one committed step, and nothing executable."""

    step: int
    created: float
    tree: dict[str, Any]
    payloads: tuple[PayloadEntry, ...]
    files: dict[str, int]
    metrics: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    rank_trees: tuple[dict[str, Any], ...] = ()  # a distributed step: the trees of ranks 1, 2, ...

    @property
    def world(self) -> int:
        """How many ranks saved the step (1 for a single process)."""
        return 1 + len(self.rank_trees)

    @property
    def partial(self) -> bool:
        """Whether the step is one rank's part of a step (a memory tier's): its shards cover only
        that rank's boxes of their global tensors, not the whole. A part is one process's step: a
        step of many ranks labelled one is not (its shards must tile, as any such step's)."""
        return PART_KEY in self.info and not self.rank_trees

    @property
    def saved_as(self) -> str | None:
        """The file name a Lightning checkpoint was saved as (CrashsafeCheckpointIO saves a state
        ``{"name": ..., "lightning": ..., ...}``); None for any other state."""
        keys = self.tree.get("keys", []) if self.tree["t"] == "dict" else []
        if "lightning" not in keys or "name" not in keys:
            return None
        node = self.tree["vals"][keys.index("name")]
        return node["v"] if node["t"] == "str" and isinstance(node["v"], str) else None

    def tree_of(self, rank: int) -> dict[str, Any]:
        """The state tree rank ``rank`` saved (rank 0's for a rank the step did not have)."""
        return self.rank_trees[rank - 1] if 0 < rank < self.world else self.tree

    @property
    def stored_nbytes(self) -> int:
        """The bytes this step's own data files hold (what deleting it frees)."""
        return sum(self.files.values())

    @property
    def referenced_nbytes(self) -> int:
        """The stored bytes of the payloads that refer to earlier steps' bytes (held there)."""
        return sum(p.nbytes for p in self.payloads if p.ref is not None)

    @property
    def references(self) -> frozenset[int]:
        """The earlier steps whose bytes this step's references are (docs/format.md, version 4)."""
        return frozenset(p.ref for p in self.payloads if p.ref is not None)

    @property
    def raw_nbytes(self) -> int:
        return sum(p.raw_nbytes for p in self.payloads)

    def to_json(self) -> dict[str, Any]:
        """Version 1 for a single process (readable by every crashsafe), 2 for many ranks, 3 for
        many ranks with chunk checksums, 4 for either with references (docs/format.md: an older
        crashsafe refuses a version it does not know)."""
        body: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "step": self.step,
            "created": self.created,
            "metrics": self.metrics,
            "info": self.info,
            "files": self.files,
            "payloads": [p.to_json() for p in self.payloads],
        }
        if self.rank_trees or any(p.rank is not None or p.shard is not None for p in self.payloads):
            chunked = any(p.chunks is not None for p in self.payloads)
            version = CHUNKED_VERSION if chunked else DISTRIBUTED_VERSION
            body.update(version=version, trees=[self.tree, *self.rank_trees])
        else:
            body["tree"] = self.tree
        if self.references:
            body["version"] = REFERENCES_VERSION
        return body


def _canonical(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def dumps(manifest: Manifest) -> bytes:
    """Manifest as one line of JSON carrying an xxh3 checksum of its own canonical form.

    The canonical form is encoded once and stored with the checksum in front. Not indented:
    indenting makes json fall back from its C encoder to the pure Python one, ~10x slower for a
    manifest of thousands of tensors (``python -m json.tool`` pretty-prints a file).
    """
    canonical = _canonical(manifest.to_json())
    checksum = xxhash.xxh3_64_hexdigest(canonical)
    return b'{"checksum":"%s",%s' % (checksum.encode(), canonical[1:])


def loads(data: bytes, where: str = "manifest") -> Manifest:
    """Parse, checksum and validate a manifest; raise CorruptCheckpointError naming the damage.

    Bounded work on any bytes: the size and the number of JSON objects and values are checked on
    the raw bytes before ``json.loads`` builds anything, and every number is bounded as it is parsed.
    """
    body, claimed = _parse_manifest(data, where)
    try:
        actual = xxhash.xxh3_64_hexdigest(_canonical(body))
    except (ValueError, RecursionError) as exc:
        raise _bad(where, f"holds values JSON cannot represent ({exc})") from None
    if claimed != actual:
        raise _bad(
            where,
            f"checksum mismatch (stored {_show(claimed)}, computed {actual!r}): the "
            "manifest was modified or damaged",
        )
    return _validate(body, where)


def check_written(data: bytes, where: str) -> Manifest:
    """:func:`loads` for the bytes :func:`dumps` just made, the writer's check that a manifest
    loads back (docs/design.md, rule 10): every check but the checksum's, which ``dumps`` took of the very
    canonical bytes a reader recomputes (JSON parses them back to values that encode the same)."""
    body, _ = _parse_manifest(data, where)
    return _validate(body, where)


def _parse_manifest(data: bytes, where: str) -> tuple[dict[str, Any], object]:
    """The manifest's fields (bounded, parsed, format and version checked) and its stored checksum."""
    _check_bounds(data, where)
    body = _parse(data, where)
    claimed = body.pop("checksum", None)
    if body.get("format") != FORMAT_NAME:
        raise _bad(where, f"is not a crashsafe manifest (format={_show(body.get('format'))})")
    version = body.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= REFERENCES_VERSION:
        raise _bad(
            where,
            f"has format version {_show(version)}; this crashsafe reads versions 1 to "
            f"{REFERENCES_VERSION}. Upgrade crashsafe to read it",
        )
    return body, claimed


def validate_file_name(name: object) -> str:
    """A data-file name safe to join to a step directory: no separators, no ``..``."""
    if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or ".." in name:
        raise CorruptCheckpointError(f"unsafe or invalid data file name {_show(name)} in manifest")
    return name


def _check_bounds(data: bytes, where: str) -> None:
    """Refuse bytes that would make ``json.loads`` build more than a legitimate manifest needs."""
    limit = "; it is damaged or forged, or its state is too large for one manifest (docs/format.md, Limits)"
    if len(data) > MAX_MANIFEST_BYTES:
        raise _bad(where, f"is {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} allowed{limit}")
    objects = data.count(b"{")
    if objects > MAX_JSON_OBJECTS:
        raise _bad(where, f"holds {objects} JSON objects, more than the {MAX_JSON_OBJECTS} allowed{limit}")
    values = objects + data.count(b"[") + data.count(b",")
    if values > MAX_JSON_VALUES:
        raise _bad(where, f"holds {values} JSON values, more than the {MAX_JSON_VALUES} allowed{limit}")


def _parse(data: bytes, where: str) -> dict[str, Any]:
    """The JSON object in ``data``: UTF-8, int64 integers, no NaN or Infinity (a float too large,
    such as 1e999, parses as inf and is refused with the checksum: JSON cannot represent it)."""
    try:
        body = json.loads(data.decode("utf-8"), parse_int=_json_int, parse_constant=_json_constant)
    except RecursionError:
        raise _bad(where, "nests JSON too deeply to be read") from None
    except ValueError as exc:  # syntax, encoding, or a number the hooks refuse
        raise _bad(where, f"is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise _bad(where, "is not a JSON object")
    return body


def _json_int(text: str) -> int:
    """Every integer in a manifest is an int64 (``int()`` itself refuses more than 4300 digits)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not MIN_INT64 <= value <= MAX_INT64:
        raise ValueError(f"integer {_show(text)} ({len(text)} characters) is not an int64")
    return value


def _json_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


_FIELDS = frozenset({"format", "version", "step", "created", "metrics", "info", "files", "payloads", "tree"})
_FIELDS_V2 = _FIELDS - {"tree"} | {"trees"}


def _validate(body: dict[str, Any], where: str) -> Manifest:
    version = body["version"]
    refs = version >= REFERENCES_VERSION  # either layout: one tree, or one per rank
    distributed = "trees" in body if refs else version >= DISTRIBUTED_VERSION
    fields = _FIELDS_V2 if distributed else _FIELDS
    if body.keys() != fields:
        raise _bad(where, f"has unexpected fields {_show(sorted(body.keys() ^ fields))}")
    step = _int(body["step"], "step", where)
    created = body["created"]
    if isinstance(created, bool) or not isinstance(created, (int, float)):  # the parser keeps it finite
        raise _bad(where, f"has an invalid creation time {_show(created)}")
    metrics = _flat(body["metrics"], "metrics", where)
    info = _flat(body["info"], "info", where)
    files = _files(body["files"], where)
    if not isinstance(body["payloads"], list):
        raise _bad(where, "has an invalid payload table")
    codecs: set[tuple[Any, ...]] = set()
    if not distributed:
        payloads = tuple(_payload(p, files, step, codecs, refs, where) for p in body["payloads"])
        _unique_paths(payloads, where)
        _marked(payloads, info, where)
        tree = body["tree"]
        validate_tree(tree, len(payloads), where, [(p.kind, p.shape) for p in payloads])
        return Manifest(step, float(created), tree, payloads, files, metrics, info)
    trees = body["trees"]
    if not isinstance(trees, list) or not 1 <= len(trees) <= MAX_RANKS:
        raise _bad(where, f"has an invalid list of rank trees ({_show(trees)[:80]})")
    chunked = version >= CHUNKED_VERSION
    payloads = tuple(
        _rank_payload(p, files, step, codecs, len(trees), chunked, refs, where) for p in body["payloads"]
    )
    _unique_parts(payloads, where)
    _marked(payloads, info, where)
    used: set[int] = set()
    for rank, tree in enumerate(trees):
        check = _TreeCheck(len(payloads), f"{where} (rank {rank})")
        check.node(tree, 0)
        used |= check.used
    if len(used) != len(payloads):
        raise _bad(where, "lists payloads that no rank's tree uses")
    return Manifest(step, float(created), trees[0], payloads, files, metrics, info, tuple(trees[1:]))


def _flat(value: object, name: str, where: str) -> dict[str, Any]:
    """``metrics`` and ``info``: flat objects of JSON scalars, which is all the writer puts there."""
    scalars = (str, int, float, type(None))
    if not isinstance(value, dict) or not all(isinstance(v, scalars) for v in value.values()):
        raise _bad(where, f"has invalid {name} {_show(value)}: want an object of numbers, strings or null")
    return value


def _files(raw: object, where: str) -> dict[str, int]:
    if not isinstance(raw, dict):
        raise _bad(where, "has an invalid file table")
    files: dict[str, int] = {}
    for name, size in raw.items():
        try:
            validate_file_name(name)
        except CorruptCheckpointError as exc:
            raise _bad(where, str(exc)) from None
        files[name] = _int(size, f"size of {name!r}", where)
    return files


_PAYLOAD_FIELDS = frozenset({"path", "kind", "dtype", "shape", "file", "offset", "nbytes", "xxh3", "codec"})
_OPTIONAL_FIELDS = frozenset({"base", "ref"})


def _payload(
    raw: object, files: dict[str, int], step: int, codecs: set[tuple[Any, ...]], refs: bool, where: str
) -> PayloadEntry:
    """One payload entry; with ``refs`` (version 4) it may refer to an earlier step's bytes: its file
    is then that step's, checked against it where it is read (``crashsafe.references``)."""
    if not isinstance(raw, dict) or not _PAYLOAD_FIELDS <= raw.keys() <= _PAYLOAD_FIELDS | _OPTIONAL_FIELDS:
        raise _bad(where, f"has a malformed payload entry {_show(raw)}")
    path = raw["path"]
    if not isinstance(path, str):
        raise _bad(where, "has a payload with a non-string path")
    at = f"payload {path[:100]!r}"
    ref = None
    if "ref" in raw:
        if not refs:
            raise _bad(where, f"{at}: refers to another step's bytes, which versions 1 to 3 do not have")
        ref = _int(raw["ref"], f"{at} referenced step", where)
        if ref >= step:
            raise _bad(where, f"{at}: refers to step {ref}, which is not earlier than step {step}")
    kind, dtype = raw["kind"], raw["dtype"]
    if not _member(kind, LEAF_KINDS):
        raise _bad(where, f"{at}: unknown kind {_show(kind)}")
    if not _member(dtype, DTYPES):
        raise _bad(where, f"{at}: unknown dtype {_show(dtype)}")
    shape = _shape(raw["shape"], DTYPES[dtype].itemsize, at, where)
    file = raw["file"]
    if ref is not None:
        try:
            validate_file_name(file)  # a file of step ``ref``: not in this step's table
        except CorruptCheckpointError as exc:
            raise _bad(where, f"{at}: {exc}") from None
    elif not _member(file, files):
        raise _bad(where, f"{at}: refers to file {_show(file)} that is not in the file table")
    offset = _int(raw["offset"], f"{at} offset", where)
    nbytes = _int(raw["nbytes"], f"{at} size", where)
    if ref is None and offset + nbytes > files[file]:  # file sizes are int64, so the range is too
        raise _bad(where, f"{at}: bytes {offset}..{offset + nbytes} lie outside {file} ({files[file]} bytes)")
    xxh3 = raw["xxh3"]
    if not isinstance(xxh3, str) or not _HEX64.fullmatch(xxh3):
        raise _bad(where, f"{at}: invalid checksum {_show(xxh3)}")
    codec = _codec(raw["codec"], codecs, at, where)
    base = _int(raw["base"], f"{at} base step", where) if "base" in raw else None
    if base is not None and base >= step:
        raise _bad(where, f"{at}: is a delta against step {base}, which is not earlier than step {step}")
    return PayloadEntry(path, kind, dtype, shape, file, offset, nbytes, xxh3, codec, base, ref=ref)


def _marked(payloads: tuple[PayloadEntry, ...], info: dict[str, Any], where: str) -> None:
    """Every step a reference refers to has its creation time in ``info`` (``base_mark``): a reader
    honours a reference only against that very save of the step."""
    for ref in sorted({p.ref for p in payloads if p.ref is not None}):
        mark = info.get(base_mark(ref))
        if isinstance(mark, bool) or not isinstance(mark, (int, float)):
            raise _bad(where, f"refers to step {ref} but records no creation time of it ({base_mark(ref)})")


def _codec(config: object, known: set[tuple[Any, ...]], at: str, where: str) -> dict[str, Any]:
    """A codec config that builds a known codec; each distinct config (types included: 3.0 is not 3)
    is built once per manifest."""
    if not isinstance(config, dict):
        raise _bad(where, f"{at}: invalid codec config {_show(config)}")
    key: tuple[Any, ...] | None = (tuple(config.items()), tuple(map(type, config.values())))
    try:
        hash(key)
    except TypeError:  # a list or object parameter: checked every time
        key = None
    if key is not None and key in known:
        return config
    try:
        get_codec(config)
    except CodecError as exc:
        raise _bad(where, f"{at}: {exc}") from None
    if key is not None:
        known.add(key)
    return config


def _shape(raw: object, itemsize: int, at: str, where: str) -> tuple[int, ...]:
    """Dimensions whose array numpy can hold: at most MAX_NDIM, at most MAX_INT64 bytes in all
    (zero dimensions aside, as numpy counts them), computed exactly rather than in wrapping int64."""
    if not isinstance(raw, list) or len(raw) > MAX_NDIM:
        raise _bad(where, f"{at}: invalid shape {_show(raw)}")
    for d in raw:
        _int(d, f"{at} dimension", where)
    size = math.prod(raw) or math.prod(d for d in raw if d)
    if size * itemsize > MAX_INT64:
        raise _bad(where, f"{at}: shape {_show(raw)} declares more than {MAX_INT64} bytes")
    return tuple(raw)


def _rank_payload(
    raw: object,
    files: dict[str, int],
    step: int,
    codecs: set[tuple[Any, ...]],
    world: int,
    chunked: bool,
    refs: bool,
    where: str,
) -> PayloadEntry:
    """A payload of a distributed step: a plain entry plus its writer's rank and, for a shard of a
    DTensor, its global shape and offset (the shard must lie inside the global tensor) and, from
    version 3 on, for a raw shard, its chunk checksums."""
    if not isinstance(raw, dict) or "rank" not in raw:
        raise _bad(where, f"has a payload without its writer's rank {_show(raw)}")
    plain = {k: v for k, v in raw.items() if k not in ("rank", "shard", "chunks")}
    entry = _payload(plain, files, step, codecs, refs, where)
    rank = _int(raw["rank"], f"payload {entry.path[:100]!r} rank", where, maximum=world - 1)
    shard = None
    if "shard" in raw:
        shard = _shard(raw["shard"], entry, where)
    entry = dataclasses.replace(entry, rank=rank, shard=shard)
    if "chunks" in raw:
        entry = dataclasses.replace(entry, chunks=_chunks(raw["chunks"], entry, chunked, where))
    return entry


def _chunks(raw: object, entry: PayloadEntry, chunked: bool, where: str) -> Chunks:
    """Chunk checksums, allowed only in version 3 and only for a shard stored raw (so that a byte
    range of the payload is a range of the array's elements): a power-of-two chunk size in
    ``[MIN_CHUNK_BYTES, MAX_CHUNK_BYTES]``, one digest per chunk, whose combination is the
    payload's checksum."""
    at = f"payload {entry.path[:100]!r}"
    if not chunked:
        raise _bad(where, f"{at}: has chunk checksums, which format versions 1 and 2 do not have")
    raw_shard = entry.codec == {"id": "raw"} and entry.nbytes == entry.raw_nbytes and entry.base is None
    if entry.shard is None or not raw_shard:
        raise _bad(where, f"{at}: has chunk checksums but is not a shard stored raw")
    if not isinstance(raw, dict) or raw.keys() != {"bytes", "xxh3"}:
        raise _bad(where, f"{at}: malformed chunk checksums {_show(raw)}")
    size = _int(raw["bytes"], f"{at} chunk size", where, MIN_CHUNK_BYTES, MAX_CHUNK_BYTES)
    if size & (size - 1):
        raise _bad(where, f"{at}: chunk size {size} is not a power of two")
    digests = raw["xxh3"]
    count = chunk_count(entry.nbytes, size)
    if not isinstance(digests, list) or len(digests) != count:
        raise _bad(where, f"{at}: want {count} chunk checksums of {size} bytes, found {_show(digests)}")
    if not all(isinstance(d, str) and _HEX64.fullmatch(d) for d in digests):
        raise _bad(where, f"{at}: invalid chunk checksums {_show(digests)}")
    if combine(digests) != entry.xxh3:
        raise _bad(where, f"{at}: its chunk checksums do not combine to its checksum {entry.xxh3}")
    return Chunks(size, tuple(digests))


def _shard(raw: object, entry: PayloadEntry, where: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    at = f"payload {entry.path[:100]!r}"
    if not isinstance(raw, dict) or raw.keys() != {"global", "offset"}:
        raise _bad(where, f"{at}: malformed shard {_show(raw)}")
    size = DTYPES[entry.dtype].itemsize
    whole = _shape(raw["global"], size, at, where)
    offset = raw["offset"]
    if not isinstance(offset, list) or len(offset) != len(whole) or len(whole) != len(entry.shape):
        raise _bad(where, f"{at}: shard offset {_show(offset)} does not fit its shapes")
    for o, n, g in zip(offset, entry.shape, whole, strict=True):
        if _int(o, f"{at} shard offset", where) + n > g:
            raise _bad(where, f"{at}: shard at {_show(offset)} of shape {entry.shape} lies outside {whole}")
    return whole, tuple(offset)


def _unique_parts(payloads: tuple[PayloadEntry, ...], where: str) -> None:
    """In a distributed step one array may have several payloads (a shard each, or one per rank for
    rank-local values), but never two for the same writer and shard."""
    seen: set[tuple[Any, ...]] = set()
    for p in payloads:
        key = (p.path, p.rank, None if p.shard is None else p.shard[1])
        if key in seen:
            raise _bad(where, f"has two payloads for {_show(p.path)} from rank {p.rank}")
        seen.add(key)


def _unique_paths(payloads: tuple[PayloadEntry, ...], where: str) -> None:
    seen: set[str] = set()
    for p in payloads:
        if p.path in seen:
            raise _bad(where, f"has two payloads with path {_show(p.path)}")
        seen.add(p.path)
