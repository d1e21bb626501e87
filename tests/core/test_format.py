"""The manifest is validated before any byte is used, even when an attacker fixes up its checksum."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import crashsafe as cs
from crashsafe.format.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    REFERENCES_VERSION,
    Manifest,
    PayloadEntry,
    _canonical,
    dumps,
    loads,
)
from crashsafe.state.tree import flatten

SRC = Path(__file__).resolve().parents[2] / "src" / "crashsafe"


def _write_forged(step_dir: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit a manifest and re-sign it, as a malicious stranger could."""
    path = step_dir / MANIFEST_NAME
    body = json.loads(path.read_text())
    body.pop("checksum")
    edit(body)
    body["checksum"] = xxhash.xxh3_64_hexdigest(_canonical(body))
    path.write_text(json.dumps(body))


def _set(field: str, value: Any, index: int = 0) -> Callable[[dict[str, Any]], None]:
    def edit(body: dict[str, Any]) -> None:
        body["payloads"][index][field] = value

    return edit


def _files(value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(body: dict[str, Any]) -> None:
        body["files"] = value

    return edit


def _tree(value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(body: dict[str, Any]) -> None:
        body["tree"] = value

    return edit


def _version(body: dict[str, Any]) -> None:
    body["version"] = REFERENCES_VERSION + 1  # newer than any version this reader knows


FORGERIES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "path escape": (_files({"../../etc/passwd": 10}), "unsafe or invalid data file name"),
    "absolute path": (_files({"/etc/passwd": 10}), "unsafe or invalid data file name"),
    "payload file not listed": (_set("file", "other.bin"), "not in the file table"),
    "offset past the end": (_set("offset", 10**9), "outside data.bin"),
    "negative size": (_set("nbytes", -1), "invalid"),
    "object dtype": (_set("dtype", "object"), "unknown dtype"),
    "pickle codec": (_set("codec", {"id": "pickle"}), "unknown codec"),
    "shape lies about size": (_set("shape", [10**6]), "expected"),
    "bool as size": (_set("nbytes", True), "invalid"),
    "dangling array id": (
        _tree({"t": "dict", "keys": ["w"], "vals": [{"t": "array", "id": 7}]}),
        "out of range",
    ),
    "unknown node": (_tree({"t": "eval", "v": "__import__('os')"}), "invalid tree node"),
    "newer version": (_version, "Upgrade crashsafe"),
}


@pytest.mark.parametrize("name", FORGERIES)
def test_forged_manifests_are_refused_before_use(tmp_path: Path, name: str) -> None:
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": np.arange(100.0), "n": 1})
    edit, message = FORGERIES[name]
    _write_forged(tmp_path / "step_000000000001", edit)
    reader = cs.CheckpointManager(tmp_path, read_only=True)
    with pytest.raises(cs.CorruptCheckpointError, match=re.escape(message)):
        reader.load(1)
    assert not cs.verify(tmp_path).ok


# Baseline checkpoint modes that the benchmarks compare against (never used to read our format).
PICKLE_BASELINES = {"workloads/checkpoint_modes.py"}


def test_no_pickle_anywhere_in_the_package() -> None:
    pattern = re.compile(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle)\b", re.M)
    offenders = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if pattern.search(p.read_text())]
    assert sorted(set(offenders) - PICKLE_BASELINES) == []


def test_manifest_is_plain_json_documenting_each_payload(tmp_path: Path) -> None:
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": np.arange(6, dtype=np.float32).reshape(2, 3)})
    body = json.loads((tmp_path / "step_000000000001" / MANIFEST_NAME).read_text())
    assert body["format"] == "crashsafe-checkpoint" and body["version"] == FORMAT_VERSION
    (entry,) = body["payloads"]
    assert entry["path"] == "w" and entry["dtype"] == "float32" and entry["shape"] == [2, 3]
    assert entry["codec"] == {"id": "raw"} and entry["nbytes"] == 24
    raw = (tmp_path / "step_000000000001" / "data.bin").read_bytes()
    assert raw[entry["offset"] : entry["offset"] + 24] == np.arange(6, dtype="<f4").tobytes()
    assert xxhash.xxh3_64_hexdigest(raw[:24]) == entry["xxh3"]


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_fuzzed_manifests_raise_only_corrupt_checkpoint_error(data: st.DataObject) -> None:
    """Random re-signed edits anywhere in a real manifest: valid, or CorruptCheckpointError, never a crash."""
    body = json.loads(_VALID.decode())
    body.pop("checksum")
    node: Any = body
    for _ in range(data.draw(st.integers(0, 4))):
        if isinstance(node, dict) and node:
            key = data.draw(st.sampled_from(sorted(node, key=str)))
            if data.draw(st.booleans()):
                node[key] = data.draw(json_values)
                break
            node = node[key]
        elif isinstance(node, list) and node:
            idx = data.draw(st.integers(0, len(node) - 1))
            if data.draw(st.booleans()):
                node[idx] = data.draw(json_values)
                break
            node = node[idx]
    body["checksum"] = xxhash.xxh3_64_hexdigest(_canonical(body))
    with contextlib.suppress(cs.CorruptCheckpointError):
        loads(json.dumps(body).encode())


@settings(max_examples=200, deadline=None)
@given(blob=st.binary(max_size=300))
def test_random_bytes_are_never_a_manifest(blob: bytes) -> None:
    with pytest.raises(cs.CorruptCheckpointError):
        loads(blob)


def _valid_manifest() -> bytes:
    state = {"w": np.arange(4.0), "opt": {0: {"m": np.zeros(2)}}, "lr": 0.1, "name": "x", "t": (1, None)}
    tree, leaves = flatten(state)
    entries = [
        PayloadEntry(
            leaf.path, leaf.kind, leaf.dtype, leaf.shape, "data.bin", 0, leaf.nbytes, "0" * 16, {"id": "raw"}
        )
        for leaf in leaves
    ]
    return dumps(Manifest(1, 0.0, tree, tuple(entries), {"data.bin": 64}))


_VALID = _valid_manifest()
