"""Hostile manifests: any bytes, however forged and re-signed, end in CorruptCheckpointError within
bounded time and memory, and restore still falls back to the newest intact step.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import crashsafe as cs
from crashsafe.format.chunks import Chunks, combine
from crashsafe.format.manifest import (
    MANIFEST_NAME,
    MAX_JSON_OBJECTS,
    MAX_JSON_VALUES,
    MAX_MANIFEST_BYTES,
    REFERENCES_VERSION,
    Manifest,
    PayloadEntry,
    _canonical,
    check_written,
    dumps,
    loads,
)

Body = dict[str, Any]
Edit = Callable[[Body], None]


def signed(body: Body) -> bytes:
    """``body`` (without its checksum) as a manifest carrying a matching checksum: a forger's work."""
    unsigned = {k: v for k, v in body.items() if k != "checksum"}
    return json.dumps({**unsigned, "checksum": xxhash.xxh3_64_hexdigest(_canonical(unsigned))}).encode()


def valid_body() -> Body:
    """A valid manifest of a small state: two arrays (one zstd, one lc), a float, an int, a dict."""
    w = PayloadEntry("w", "numpy", "float32", (2, 3), "data.bin", 0, 24, "0" * 16, {"id": "raw"})
    codec = {"id": "lc", "bits": 3, "rep": "midrange", "full_every": 100}
    m = PayloadEntry("opt.m", "torch", "float32", (4,), "data.bin", 24, 16, "1" * 16, codec, base=1)
    tree = {
        "t": "dict",
        "keys": ["w", "opt", "lr", "n"],
        "vals": [
            {"t": "array", "id": 0},
            {"t": "dict", "keys": [0, "m"], "vals": [{"t": "none"}, {"t": "array", "id": 1}]},
            {"t": "float", "v": (0.5).hex()},
            {"t": "int", "v": "12"},
        ],
    }
    manifest = Manifest(2, 1.5, tree, (w, m), {"data.bin": 40}, {"loss": 0.25}, {"crashsafe": "0.1.0"})
    body: Body = json.loads(dumps(manifest))
    return body


def test_the_valid_body_loads() -> None:
    manifest = loads(signed(valid_body()))
    assert [p.path for p in manifest.payloads] == ["w", "opt.m"] and manifest.payloads[1].base == 1


def _set(*where: str | int, value: Any) -> Edit:
    """An edit that sets ``body[where[0]][where[1]]... = value``."""

    def edit(body: Body) -> None:
        node: Any = body
        for key in where[:-1]:
            node = node[key]
        node[where[-1]] = value

    return edit


def _duplicate_path(body: Body) -> None:
    body["payloads"][1]["path"] = "w"


FORGED: dict[str, tuple[Edit, str]] = {
    "float node overflows": (_set("tree", "vals", 2, "v", value="0x1p99999"), "malformed 'float' value"),
    "shape product wraps int64": (_set("payloads", 0, "shape", value=[2**62 + 1, 4]), "declares more than"),
    "shape of zero and giants": (_set("payloads", 0, "shape", value=[0, 2**62, 2**62]), "declares more than"),
    "too many dimensions": (_set("payloads", 0, "shape", value=[1] * 65), "invalid shape"),
    "lc bits 3.0": (_set("payloads", 1, "codec", "bits", value=3.0), "lc bits must be an int"),
    "lc bits True": (_set("payloads", 1, "codec", "bits", value=True), "lc bits must be an int"),
    "lc rep list": (_set("payloads", 1, "codec", "rep", value=["midrange"]), "lc rep must be one of"),
    "zstd level str": (_set("payloads", 0, "codec", value={"id": "zstd", "level": "1"}), "zstd level"),
    "unknown codec parameter": (_set("payloads", 0, "codec", value={"id": "raw", "x": 1}), "invalid param"),
    "unknown codec": (_set("payloads", 0, "codec", value={"id": "pickle"}), "unknown codec"),
    "int node with spaces and _": (_set("tree", "vals", 3, "v", value=" 1_0 "), "malformed 'int' value"),
    "int node of 4301 digits": (_set("tree", "vals", 3, "v", value="9" * 4301), "malformed 'int' value"),
    "int node as a JSON int": (_set("tree", "vals", 3, "v", value=12), "malformed 'int' value"),
    "duplicate payload paths": (_duplicate_path, "two payloads with path 'w'"),
    "range past the file": (_set("payloads", 1, "nbytes", value=2**63 - 24), "outside data.bin"),
    "base not earlier": (_set("payloads", 1, "base", value=2), "not earlier than step 2"),
    "nested metrics": (_set("metrics", value={"loss": [0.25]}), "invalid metrics"),
    "nested info": (_set("info", value={"crashsafe": {"v": 1}}), "invalid info"),
    "dict key bool": (_set("tree", "vals", 1, "keys", value=[True, "m"]), "not a str or an int64"),
    "dict keys duplicate": (_set("tree", "vals", 1, "keys", value=["m", "m"]), "duplicate keys"),
    "version true": (_set("version", value=True), "format version True"),
    "file name with a newline": (_set("files", value={"data.bin\n": 40}), "unsafe or invalid data file name"),
    "created as a string": (_set("created", value="now"), "invalid creation time"),
}


@pytest.mark.parametrize("name", FORGED)
def test_re_signed_forgeries_are_corrupt_checkpoint_errors(name: str) -> None:
    edit, message = FORGED[name]
    body = valid_body()
    edit(body)
    with pytest.raises(cs.CorruptCheckpointError, match=message):
        loads(signed(body))


TEXT_FORGERIES = {
    "5000-digit step": ('"step": 2', '"step": ' + "9" * 5000, "is not an int64"),
    "5000-digit shape": ('"shape": [2, 3]', '"shape": [2, ' + "9" * 5000 + "]", "is not an int64"),
    "5000-digit metric": ('"loss": 0.25', '"loss": -' + "9" * 5000, "is not an int64"),
    "2**63 step": ('"step": 2', '"step": 9223372036854775808', "is not an int64"),
    "NaN created": ('"created": 1.5', '"created": NaN', "NaN is not a JSON number"),
    "-Infinity metric": ('"loss": 0.25', '"loss": -Infinity', "-Infinity is not a JSON number"),
    "1e999 created": ('"created": 1.5', '"created": 1e999', "JSON cannot represent"),
}


@pytest.mark.parametrize("name", TEXT_FORGERIES)
def test_numbers_json_or_int64_cannot_hold_are_refused_while_parsing(name: str) -> None:
    """No checksum needed: these fail before it is computed (a 5000-digit int raised ValueError)."""
    old, new, message = TEXT_FORGERIES[name]
    text = signed(valid_body()).decode()
    assert old in text
    with pytest.raises(cs.CorruptCheckpointError, match=message):
        loads(text.replace(old, new, 1).encode())


nasty_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.sampled_from([2**62 + 1, 2**40, -1, 0, 3.0, 1e308, "0x1p99999", " 1_0 ", "9" * 30, "nan", "", ".."])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=8,
)
HOSTILE = settings(max_examples=400, deadline=2000, suppress_health_check=[HealthCheck.too_slow])


@HOSTILE
@given(data=st.data())
def test_re_signed_mutations_load_or_are_corrupt_checkpoint_errors(data: st.DataObject) -> None:
    """Replace any value anywhere in a valid manifest, re-sign: a Manifest or CorruptCheckpointError."""
    _mutate_re_sign_and_load(data, valid_body(), nasty_values)


def _mutate_re_sign_and_load(data: st.DataObject, body: Body, values: st.SearchStrategy[Any]) -> None:
    """Replace one value anywhere in ``body`` by one of ``values`` and re-sign it: the reader gives
    a Manifest or a CorruptCheckpointError, never another error. What it accepts, the writer's
    bytes give back equal, and the writer's own check (``check_written``: all but the checksum it
    just took) agrees."""
    body.pop("checksum")
    node: Any = body
    while True:
        keys = sorted(node, key=str) if isinstance(node, dict) else list(range(len(node)))
        key = data.draw(st.sampled_from(keys))
        child = node[key]
        if not isinstance(child, (dict, list)) or not child or data.draw(st.booleans()):
            node[key] = data.draw(values)
            break
        node = child
    try:
        manifest = loads(signed(body))
    except cs.CorruptCheckpointError:
        return
    assert isinstance(manifest, Manifest)
    written = dumps(manifest)
    assert loads(written) == manifest
    assert check_written(written, "manifest") == manifest


def _same_json(blob: bytes, valid: bytes) -> bool:
    """Whether ``blob`` is ``valid``'s very manifest (whitespace between tokens aside)."""
    try:
        return bool(json.loads(blob) == json.loads(valid))
    except ValueError:
        return False


def _damaged_valid_manifest() -> st.SearchStrategy[bytes]:
    valid = signed(valid_body())
    at = st.integers(0, len(valid) - 1)
    return st.one_of(
        at.map(lambda k: valid[:k]),
        st.tuples(at, st.binary(min_size=1, max_size=8))
        .map(lambda t: valid[: t[0]] + t[1] + valid[t[0] + 1 :])
        .filter(lambda blob: not _same_json(blob, valid)),  # a byte over itself, a space for a tab: no damage
        st.tuples(at, st.sampled_from([b"{", b"[", b"9" * 5000, b"NaN", b"\xff", b"\\ud800"])).map(
            lambda t: valid[: t[0]] + t[1] + valid[t[0] :]
        ),
    )


json_ish = st.text(alphabet='{}[]":,0123456789.eE-+ tfrualsnNIy\\', max_size=400).map(str.encode)


@HOSTILE
@given(blob=st.binary(max_size=400) | json_ish | _damaged_valid_manifest())
def test_any_bytes_as_a_manifest_are_a_corrupt_checkpoint_error(blob: bytes) -> None:
    with pytest.raises(cs.CorruptCheckpointError):
        loads(blob)


# ------------------------------------------------------------------------------- size bounds


def _signed_list_tree(node: bytes, count: int) -> bytes:
    """A re-signed manifest whose tree is a list of ``count`` copies of ``node`` (canonical JSON),
    built as bytes: parsing it to sign it would cost what the test is about."""
    canonical = (
        b'{"created":0.0,"files":{},"format":"crashsafe-checkpoint","info":{},"metrics":{},'
        b'"payloads":[],"step":1,"tree":{"items":['
        + b",".join([node] * count)
        + b'],"t":"list"},"version":1}'
    )
    return canonical[:-1] + b',"checksum":"' + xxhash.xxh3_64_hexdigest(canonical).encode() + b'"}'


def test_the_list_tree_builder_signs_correctly() -> None:
    manifest = loads(_signed_list_tree(b'{"t":"int","v":"1"}', 3))
    assert manifest.tree == {"t": "list", "items": [{"t": "int", "v": "1"}] * 3}


def test_a_manifest_of_two_million_tree_nodes_is_refused_fast_in_little_memory() -> None:
    """It took 1.17 GB to load: it is now refused by counting bytes, before json.loads."""
    forged = _signed_list_tree(b'{"t":"int","v":"1234567890123"}', 2_000_000)
    assert len(forged) > 60_000_000
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(cs.CorruptCheckpointError, match="JSON objects, more than"):
            loads(forged)
        elapsed = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 1.0 and peak < 1 << 20, (elapsed, peak)


@pytest.mark.parametrize(
    ("node", "message"),
    [(b"[]", "JSON values, more than"), (b'"' + b"x" * 100 + b'"', "bytes, more than")],
)
def test_manifests_over_the_value_and_byte_bounds_are_refused_unparsed(node: bytes, message: str) -> None:
    count = MAX_JSON_VALUES if node == b"[]" else MAX_MANIFEST_BYTES // 100
    with pytest.raises(cs.CorruptCheckpointError, match=message):
        loads(_signed_list_tree(node, count))


def moe_manifest(layers: int, experts: int = 128) -> Manifest:
    """A mixture-of-experts model (``layers`` x ``experts`` x 3 expert weights, attention, norms,
    router) with AdamW state (step, exp_avg, exp_avg_sq per parameter): 96 layers = 150k tensors."""
    params: list[tuple[str, tuple[int, ...]]] = []
    for layer in range(layers):
        at = f"model.layers.{layer}"
        experts_at = [f"{at}.mlp.experts.{e}.{p}_proj.weight" for e in range(experts) for p in "gud"]
        params += [(name, (1408, 2048)) for name in experts_at]
        params += [(f"{at}.self_attn.{p}_proj.weight", (2048, 2048)) for p in "qkvo"]
        params += [(f"{at}.{norm}_layernorm.weight", (2048,)) for norm in ("input", "post_attention")]
        params += [(f"{at}.mlp.gate.weight", (experts, 2048))]
    payloads: list[PayloadEntry] = []
    zstd = {"id": "zstd", "level": 1, "shuffle": True}

    def leaf(path: str, shape: tuple[int, ...], codec: dict[str, Any]) -> dict[str, Any]:
        offset = payloads[-1].offset + payloads[-1].nbytes if payloads else 0
        nbytes = int(np.prod(shape)) * 4 // 3  # about what zstd stores
        entry = PayloadEntry(path, "torch", "float32", shape, "data.bin", offset, nbytes, "0" * 16, codec)
        payloads.append(entry)
        return {"t": "array", "id": len(payloads) - 1}

    model = [leaf(name, shape, zstd) for name, shape in params]
    state = [
        {
            "t": "dict",
            "keys": ["step", "exp_avg", "exp_avg_sq"],
            "vals": [
                leaf(f"optim.state.{i}.{k}", s, zstd if s else {"id": "raw"})
                for k, s in (("step", ()), ("exp_avg", shape), ("exp_avg_sq", shape))
            ],
        }
        for i, (_, shape) in enumerate(params)
    ]
    group = {
        "t": "dict",
        "keys": ["lr", "params"],
        "vals": [
            {"t": "float", "v": (1e-4).hex()},
            {"t": "list", "items": [{"t": "int", "v": str(i)} for i in range(len(params))]},
        ],
    }
    optim = {
        "t": "dict",
        "keys": ["state", "param_groups"],
        "vals": [
            {"t": "dict", "keys": list(range(len(params))), "vals": state},
            {"t": "list", "items": [group]},
        ],
    }
    tree = {
        "t": "dict",
        "keys": ["model", "optim"],
        "vals": [
            {
                "t": "stateful",
                "class": "MoE",
                "value": {"t": "dict", "keys": [n for n, _ in params], "vals": model},
            },
            {"t": "stateful", "class": "torch.optim.AdamW", "value": optim},
        ],
    }
    files = {"data.bin": payloads[-1].offset + payloads[-1].nbytes}
    return Manifest(10**6, 1.7e9, tree, tuple(payloads), files, {"loss": 1.5}, {"crashsafe": "0.1.0"})


def test_a_state_of_150k_tensors_fits_the_bounds() -> None:
    """Counts grow by the same amount per layer: 4 and 8 layers load, and 96 layers (150k tensors)
    extrapolate to within the bounds with room to spare (building it whole takes ~10 s)."""
    sizes = []
    for layers in (4, 8):
        data = dumps(moe_manifest(layers))
        assert len(loads(data).payloads) == layers * 391 * 4
        sizes.append(np.array([len(data), data.count(b"{"), sum(data.count(c) for c in (b"{", b"[", b","))]))
    at_96 = sizes[1] + (sizes[1] - sizes[0]) * (96 - 8) / 4
    bounds = np.array([MAX_MANIFEST_BYTES, MAX_JSON_OBJECTS, MAX_JSON_VALUES])
    assert np.all(at_96 * 1.25 < bounds), (at_96, bounds)


# ---------------------------------------------------------------- chunk checksums (version 3)


def chunked_body() -> Body:
    """A valid version 3 manifest: array w of (4, 2048) float32 in two raw shards of 4 chunks."""
    payloads, trees = [], []
    for rank in (0, 1):
        chunks = Chunks(4096, tuple(f"{rank}{i:015x}" for i in range(4)))
        entry = PayloadEntry(
            "w", "torch", "float32", (2, 2048), f"data-r{rank}.bin", 0, 16384, chunks.combined(),
            {"id": "raw"}, None, rank, ((4, 2048), (2 * rank, 0)), chunks,
        )  # fmt: skip
        payloads.append(entry)
        trees.append({"t": "dict", "keys": ["w"], "vals": [{"t": "array", "id": rank}]})
    files = {"data-r0.bin": 16384, "data-r1.bin": 16384}
    manifest = Manifest(2, 1.5, trees[0], tuple(payloads), files, rank_trees=(trees[1],))
    body: Body = json.loads(dumps(manifest))
    return body


def test_the_chunked_body_loads() -> None:
    manifest = loads(signed(chunked_body()))
    assert [p.chunks and len(p.chunks.xxh3) for p in manifest.payloads] == [4, 4]


def _chunks(**change: Any) -> Edit:
    def edit(body: Body) -> None:
        body["payloads"][0]["chunks"].update(change)

    return edit


def _payload(**change: Any) -> Edit:
    def edit(body: Body) -> None:
        body["payloads"][0].update(change)

    return edit


def _digest(value: str, fix_checksum: bool = False) -> Edit:
    def edit(body: Body) -> None:
        entry = body["payloads"][0]
        entry["chunks"]["xxh3"][2] = value
        if fix_checksum:
            entry["xxh3"] = combine(entry["chunks"]["xxh3"])

    return edit


def _drop(key: str) -> Edit:
    return lambda body: body["payloads"][0].pop(key)


FORGED_CHUNKS: dict[str, tuple[Edit, str]] = {
    "chunks in version 2": (lambda body: body.update(version=2), "format versions 1 and 2 do not have"),
    "chunks on an unsharded payload": (_drop("shard"), "is not a shard stored raw"),
    "chunks on a zstd shard": (_payload(codec={"id": "zstd", "level": 1}), "is not a shard stored raw"),
    "chunks on a delta": (_payload(base=1), "is not a shard stored raw"),
    "stored bytes are not the array's": (_payload(nbytes=16000), "is not a shard stored raw"),
    "chunks as a list": (_payload(chunks=[4096, "0" * 16]), "malformed chunk checksums"),
    "chunks without digests": (_payload(chunks={"bytes": 4096}), "malformed chunk checksums"),
    "chunks with another field": (_chunks(more=1), "malformed chunk checksums"),
    "size not a power of two": (_chunks(bytes=6144), "is not a power of two"),
    "size below 4 KiB": (_chunks(bytes=2048), "invalid payload 'w' chunk size"),
    "size over 1 GiB": (_chunks(bytes=2**31), "invalid payload 'w' chunk size"),
    "size true": (_chunks(bytes=True), "invalid payload 'w' chunk size"),
    "size 4096.0": (_chunks(bytes=4096.0), "invalid payload 'w' chunk size"),
    "one digest short": (_chunks(xxh3=["0" * 16] * 3), "want 4 chunk checksums of 4096 bytes"),
    "one digest too many": (_chunks(xxh3=["0" * 16] * 5), "want 4 chunk checksums"),
    "digests as a string": (_chunks(xxh3="0" * 64), "want 4 chunk checksums"),
    "a digest in upper case": (_digest("ABCDEF0123456789", fix_checksum=True), "invalid chunk checksums"),
    "a digest too short": (_digest("0" * 15), "invalid chunk checksums"),
    "a digest as an int": (_chunks(xxh3=["0" * 16, "1" * 16, 7, "2" * 16]), "invalid chunk checksums"),
    "a digest changed": (_digest("f" * 16), "do not combine to its checksum"),
}


@pytest.mark.parametrize("name", FORGED_CHUNKS)
def test_re_signed_forgeries_of_chunk_checksums_are_refused(name: str) -> None:
    edit, message = FORGED_CHUNKS[name]
    body = chunked_body()
    edit(body)
    with pytest.raises(cs.CorruptCheckpointError, match=message):
        loads(signed(body))


def test_an_older_crashsafe_message_for_a_newer_version_is_kept() -> None:
    body = chunked_body()
    body["version"] = REFERENCES_VERSION + 1
    with pytest.raises(cs.CorruptCheckpointError, match="reads versions 1 to 4. Upgrade crashsafe"):
        loads(signed(body))


chunk_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=17),
    st.sampled_from([4096, 2**30, 2**31, 3.0, "0" * 16]),
    st.lists(st.sampled_from(["0" * 16, "f" * 16, 1, None]), max_size=6),
)  # fmt: skip


@HOSTILE
@given(data=st.data())
def test_re_signed_mutations_of_a_chunked_manifest_load_or_are_corrupt_checkpoint_errors(
    data: st.DataObject,
) -> None:
    """Replace any value anywhere in a valid version 3 manifest, re-sign: a Manifest or a
    CorruptCheckpointError, never another error."""
    _mutate_re_sign_and_load(data, chunked_body(), chunk_values)


# ------------------------------------------------------------------------------ references (version 4)


def references_body(distributed: bool) -> Body:
    """A valid version 4 manifest: step 2 whose first payload refers to step 1's bytes (a file of
    step 1, in no table of step 2), in one process's layout or the ranks' (with chunk checksums)."""
    body = chunked_body() if distributed else valid_body()
    body["payloads"][0].update(ref=1, file="data-held.bin")
    body["info"] = {**body["info"], "base_created.1": 0.5}
    body["version"] = REFERENCES_VERSION
    return body


@pytest.mark.parametrize("distributed", [False, True], ids=["tree", "trees"])
def test_a_version_4_body_loads_in_either_layout(distributed: bool) -> None:
    manifest = loads(signed(references_body(distributed)))
    assert manifest.payloads[0].ref == 1 and manifest.references == {1} and manifest.world == 1 + distributed
    assert json.loads(dumps(manifest))["version"] == REFERENCES_VERSION and loads(dumps(manifest)) == manifest


@pytest.mark.parametrize("version", [1, 2, 3])
def test_a_reference_in_versions_1_to_3_is_refused(version: int) -> None:
    body = references_body(version > 1)
    body["version"] = version
    message = "refers to another step's bytes, which versions 1 to 3 do not have"
    with pytest.raises(cs.CorruptCheckpointError, match=message):
        loads(signed(body))


def test_version_4_has_one_layout_at_a_time() -> None:
    body = references_body(False)
    body["trees"] = [body["tree"]]
    with pytest.raises(cs.CorruptCheckpointError, match="unexpected fields"):
        loads(signed(body))


@HOSTILE
@given(data=st.data(), distributed=st.booleans())
def test_re_signed_mutations_of_a_version_4_manifest_load_or_are_corrupt_checkpoint_errors(
    data: st.DataObject, distributed: bool
) -> None:
    _mutate_re_sign_and_load(data, references_body(distributed), nasty_values | chunk_values)


# ------------------------------------------------------------------------------ end to end


def _first(node: Any, t: str) -> dict[str, Any]:
    """The first tree node of type ``t`` (depth first)."""
    if isinstance(node, dict):
        if node.get("t") == t:
            return node
        children = node.get("vals") or node.get("items") or ([node["value"]] if "value" in node else [])
        for child in children:
            try:
                return _first(child, t)
            except LookupError:
                pass
    raise LookupError(t)


def _payload(body: Body, path: str) -> dict[str, Any]:
    (entry,) = [p for p in body["payloads"] if p["path"] == path]
    assert isinstance(entry, dict)
    return entry


def _forge_frame(step: Path, body: Body) -> None:
    """Append w's zstd frame re-headed to claim 2**40 bytes to data.bin; point w at it, re-checksummed."""
    entry = _payload(body, "w")
    data = step / "data.bin"
    frame = data.read_bytes()[entry["offset"] : entry["offset"] + entry["nbytes"]]
    header = zstandard.frame_header_size(frame)
    forged = frame[:4] + bytes([0xC0, 0x50]) + (2**40).to_bytes(8, "little") + frame[header:]
    entry.update(offset=data.stat().st_size, nbytes=len(forged), xxh3=xxhash.xxh3_64_hexdigest(forged))
    with data.open("ab") as out:
        out.write(forged)
    body["files"]["data.bin"] = data.stat().st_size


E2E: dict[str, Callable[[Path, Body], None]] = {
    "float node 0x1p99999": lambda step, body: _first(body["tree"], "float").update(v="0x1p99999"),
    "shape [2**62+1, 4]": lambda step, body: _payload(body, "w").update(shape=[2**62 + 1, 4]),
    "shape [2**40]": lambda step, body: _payload(body, "w").update(shape=[2**40]),
    "lc bits 3.0": lambda step, body: _payload(body, "w").update(codec={"id": "lc", "bits": 3.0}),
    "zstd frame claiming 2**40 bytes": _forge_frame,
}


@pytest.mark.parametrize("name", [*E2E, "5000-digit int"])
def test_restore_falls_back_from_a_forged_step_and_verify_reports_it(tmp_path: Path, name: str) -> None:
    def state(step: int) -> dict[str, Any]:
        return {"w": np.arange(1000, dtype=np.float32) * step, "lr": 0.5 / step, "n": step}

    with cs.CheckpointManager(tmp_path, codec="zstd") as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
    step_dir = tmp_path / "step_000000000002"
    manifest = step_dir / MANIFEST_NAME
    if name == "5000-digit int":  # needs no checksum: parsing fails first
        text = manifest.read_text()
        manifest.write_text(text.replace('"step":2', '"step":' + "9" * 5000, 1))
    else:
        body = json.loads(manifest.read_text())
        E2E[name](step_dir, body)
        manifest.write_bytes(signed(body))

    live = {"w": np.zeros(1000, dtype=np.float32), "lr": 0.0, "n": 0}
    with cs.CheckpointManager(tmp_path, read_only=True) as reader, pytest.warns(cs.CorruptCheckpointWarning):
        assert reader.restore(live) == 1
    assert np.array_equal(live["w"], state(1)["w"]) and live["lr"] == 0.5 and live["n"] == 1
    report = cs.verify(tmp_path)
    assert [(s.step, s.ok) for s in report.steps] == [(1, True), (2, False)]
