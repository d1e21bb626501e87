"""The on-disk manifest: versioned JSON, self-checksummed, validated before any byte is used.

See ``docs/format.md``. A manifest describes one committed step: the state's tree, one entry per
payload (where its bytes live, how they are encoded, their xxh3 checksum) and the data files'
sizes. Nothing in it is ever executed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import xxhash

from crashsafe.errors import CorruptCheckpointError
from crashsafe.format.dtypes import DTYPES

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "Manifest",
    "PayloadEntry",
    "dumps",
    "loads",
    "validate_file_name",
    "validate_tree",
]

FORMAT_NAME = "crashsafe-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_TREE_DEPTH = 200
MAX_NDIM = 64
MAX_STEP = 2**63 - 1  # steps are int64 everywhere (names, JSON, other tools)
MAX_TREE_NODES = 1_000_000
LEAF_KINDS = frozenset({"torch", "numpy", "npscalar", "bytes"})
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_HEX64 = re.compile(r"^[0-9a-f]{16}$")


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

    @property
    def stored_nbytes(self) -> int:
        return sum(self.files.values())

    @property
    def raw_nbytes(self) -> int:
        return sum(p.raw_nbytes for p in self.payloads)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "step": self.step,
            "created": self.created,
            "metrics": self.metrics,
            "info": self.info,
            "files": self.files,
            "payloads": [p.to_json() for p in self.payloads],
            "tree": self.tree,
        }


def _canonical(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def dumps(manifest: Manifest) -> bytes:
    """Manifest as JSON bytes carrying an xxh3 checksum of its own canonical form."""
    body = manifest.to_json()
    body["checksum"] = xxhash.xxh3_64_hexdigest(_canonical(body))
    return json.dumps(body, indent=1, sort_keys=True, allow_nan=False).encode()


def loads(data: bytes, where: str = "manifest") -> Manifest:
    """Parse, checksum and validate a manifest; raise CorruptCheckpointError naming the damage."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise _bad(where, f"is {len(data)} bytes, larger than the {MAX_MANIFEST_BYTES} allowed")
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _bad(where, f"is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise _bad(where, "is not a JSON object")
    claimed = body.pop("checksum", None)
    if body.get("format") != FORMAT_NAME:
        raise _bad(where, f"is not a crashsafe manifest (format={body.get('format')!r})")
    version = body.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise _bad(
            where,
            f"has format version {version!r}; this crashsafe reads version "
            f"{FORMAT_VERSION}. Upgrade crashsafe to read it",
        )
    try:
        actual = xxhash.xxh3_64_hexdigest(_canonical(body))
    except ValueError as exc:
        raise _bad(where, f"holds values JSON cannot represent ({exc})") from None
    if claimed != actual:
        raise _bad(
            where,
            f"checksum mismatch (stored {claimed!r}, computed {actual!r}): the "
            "manifest was modified or damaged",
        )
    return _validate(body, where)


def validate_file_name(name: object) -> str:
    """A data-file name safe to join to a step directory: no separators, no ``..``."""
    if not isinstance(name, str) or not _FILE_NAME.match(name) or ".." in name:
        raise CorruptCheckpointError(f"unsafe or invalid data file name {name!r} in manifest")
    return name


def _bad(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where} {what}")


def _member(value: object, allowed: Collection[str]) -> bool:
    """``value in allowed`` for untrusted values (a list would make ``in`` raise TypeError)."""
    return isinstance(value, str) and value in allowed


def _int(value: object, what: str, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(where, f"has invalid {what}: {value!r}")
    return value


def _validate(body: dict[str, Any], where: str) -> Manifest:
    expected = {"format", "version", "step", "created", "metrics", "info", "files", "payloads", "tree"}
    if set(body) != expected:
        raise _bad(where, f"has unexpected fields {sorted(set(body) ^ expected)}")
    step = _int(body["step"], "step", where)
    created = body["created"]
    if not isinstance(created, (int, float)):
        raise _bad(where, "has an invalid creation time")
    for name in ("metrics", "info"):
        if not isinstance(body[name], dict):
            raise _bad(where, f"has invalid {name}")
    files_raw = body["files"]
    if not isinstance(files_raw, dict):
        raise _bad(where, "has an invalid file table")
    files: dict[str, int] = {}
    for name, size in files_raw.items():
        try:
            files[validate_file_name(name)] = _int(size, f"size of {name!r}", where)
        except CorruptCheckpointError as exc:
            raise _bad(where, str(exc)) from None
    if not isinstance(body["payloads"], list):
        raise _bad(where, "has an invalid payload table")
    payloads = tuple(_payload(p, files, step, where) for p in body["payloads"])
    tree = body["tree"]
    validate_tree(tree, len(payloads), where)
    return Manifest(step, float(created), tree, payloads, files, body["metrics"], body["info"])


def _payload(raw: object, files: dict[str, int], step: int, where: str) -> PayloadEntry:
    fields = {"path", "kind", "dtype", "shape", "file", "offset", "nbytes", "xxh3", "codec"}
    if not isinstance(raw, dict) or set(raw) - {"base"} != fields:
        raise _bad(where, f"has a malformed payload entry {str(raw)[:200]}")
    path = raw["path"]
    if not isinstance(path, str):
        raise _bad(where, "has a payload with a non-string path")
    at = f"payload '{path}'"
    if not _member(raw["kind"], LEAF_KINDS):
        raise _bad(where, f"{at}: unknown kind {raw['kind']!r}")
    if not _member(raw["dtype"], DTYPES):
        raise _bad(where, f"{at}: unknown dtype {raw['dtype']!r}")
    shape = raw["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise _bad(where, f"{at}: invalid shape {shape!r}")
    dims = tuple(_int(d, f"{at} dimension", where) for d in shape)
    file = raw["file"]
    if not _member(file, files):
        raise _bad(where, f"{at}: refers to file {file!r} that is not in the file table")
    offset = _int(raw["offset"], f"{at} offset", where)
    nbytes = _int(raw["nbytes"], f"{at} size", where)
    if offset + nbytes > files[file]:
        raise _bad(where, f"{at}: bytes {offset}..{offset + nbytes} lie outside {file} ({files[file]} bytes)")
    if not isinstance(raw["xxh3"], str) or not _HEX64.match(raw["xxh3"]):
        raise _bad(where, f"{at}: invalid checksum {raw['xxh3']!r}")
    codec = raw["codec"]
    if not isinstance(codec, dict) or not isinstance(codec.get("id"), str):
        raise _bad(where, f"{at}: invalid codec config {codec!r}")
    base = _int(raw["base"], f"{at} base step", where) if "base" in raw else None
    if base is not None and base >= step:
        raise _bad(where, f"{at}: is a delta against step {base}, which is not earlier than step {step}")
    return PayloadEntry(path, raw["kind"], raw["dtype"], dims, file, offset, nbytes, raw["xxh3"], codec, base)


_NODE_FIELDS: dict[str, set[str]] = {
    "none": {"t"},
    "bool": {"t", "v"},
    "int": {"t", "v"},
    "float": {"t", "v"},
    "str": {"t", "v"},
    "array": {"t", "id"},
    "dict": {"t", "keys", "vals"},
    "list": {"t", "items"},
    "tuple": {"t", "items"},
    "stateful": {"t", "class", "value"},
}
_SCALAR_TYPES: dict[str, type] = {"bool": bool, "int": str, "float": str, "str": str}


def validate_tree(tree: object, n_payloads: int, where: str = "state tree") -> None:
    """Raise CorruptCheckpointError unless ``tree`` is a state tree the reader accepts, using each
    of ``n_payloads`` arrays exactly once. The writer runs it too, so what saves also loads."""
    used: set[int] = set()
    nodes = [0]
    _validate_tree(tree, n_payloads, used, 0, where, nodes)
    if len(used) != n_payloads:
        raise _bad(where, "lists payloads that its tree never uses")


def _validate_tree(
    node: object, n_payloads: int, used: set[int], depth: int, where: str, nodes: list[int]
) -> None:
    nodes[0] += 1
    if nodes[0] > MAX_TREE_NODES:
        raise _bad(where, f"has more than {MAX_TREE_NODES} tree nodes")
    if depth > MAX_TREE_DEPTH:
        raise _bad(where, f"has a state tree deeper than {MAX_TREE_DEPTH}")
    if not isinstance(node, dict) or not isinstance(node.get("t"), str) or node["t"] not in _NODE_FIELDS:
        raise _bad(where, f"has an invalid tree node {str(node)[:200]}")
    t = node["t"]
    if set(node) != _NODE_FIELDS[t]:
        raise _bad(where, f"has a malformed {t!r} tree node")
    if t in _SCALAR_TYPES:
        if not isinstance(node["v"], _SCALAR_TYPES[t]):
            raise _bad(where, f"has a malformed {t!r} value")
        try:
            if t == "int":
                int(str(node["v"]))
            elif t == "float":
                float.fromhex(str(node["v"]))
        except ValueError:
            raise _bad(where, f"has a malformed {t!r} value {node['v']!r}") from None
    elif t == "array":
        idx = _int(node["id"], "array id", where)
        if idx >= n_payloads or idx in used:
            raise _bad(where, f"has an array id {idx} that is out of range or used twice")
        used.add(idx)
    elif t == "dict":
        keys, vals = node["keys"], node["vals"]
        if not isinstance(keys, list) or not isinstance(vals, list) or len(keys) != len(vals):
            raise _bad(where, "has a malformed dict node")
        if any(isinstance(k, bool) or not isinstance(k, (str, int)) for k in keys):
            raise _bad(where, "has a dict key that is not a str or int")
        if len(set(keys)) != len(keys):
            raise _bad(where, "has a dict node with duplicate keys")
        for v in vals:
            _validate_tree(v, n_payloads, used, depth + 1, where, nodes)
    elif t in ("list", "tuple"):
        if not isinstance(node["items"], list):
            raise _bad(where, f"has a malformed {t} node")
        for v in node["items"]:
            _validate_tree(v, n_payloads, used, depth + 1, where, nodes)
    elif t == "stateful":
        if not isinstance(node["class"], str):
            raise _bad(where, "has a malformed stateful node")
        _validate_tree(node["value"], n_payloads, used, depth + 1, where, nodes)
