"""Steps whose unchanged payloads refer to an earlier step's bytes (format version 4, issue 29): read
through their references by every reader (load, mmap, restore in place, verify, export, diff), and
through delta chains that run through references; the manifest format of versions 1 to 3 unchanged."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crashsafe as cs
from crashsafe.chain import ChainReader, direct_bases
from crashsafe.codecs.base import Reference
from crashsafe.diff import diff_steps
from crashsafe.export import export_safetensors
from crashsafe.format.manifest import MANIFEST_NAME, Manifest, PayloadEntry, base_mark, dumps, loads
from crashsafe.storage.layout import step_dir
from crashsafe.storage.local import LocalStore
from crashsafe.storage.reader import StepReader
from crashsafe.storage.writer import StepWriter, delete_steps

from ..refsteps import commit_references, resign

INCREMENTAL = cs.codecs.Incremental(full_every=100)


def state(step: int, frozen: int) -> dict[str, Any]:
    """A fine-tuning state: a frozen base (the values of step ``frozen``), a head, python values."""
    return {
        "base": {"w": np.full((64, 32), float(frozen), dtype=np.float32), "b": np.arange(32.0) + frozen},
        "head": np.full(16, float(step)),
        "step": step,
    }


def _same(loaded: dict[str, Any], expected: dict[str, Any]) -> None:
    assert loaded["step"] == expected["step"]
    for key in ("w", "b"):
        assert np.array_equal(np.asarray(loaded["base"][key]), expected["base"][key]), key
    assert np.array_equal(np.asarray(loaded["head"]), expected["head"])


def _run(directory: Path, codec: Any = None) -> Manifest:
    """Steps 10 and 20 saved by a manager; step 30 commits the base as references to step 20."""
    with cs.CheckpointManager(directory, keep_last=None, codec=codec, async_save=False) as mgr:
        mgr.save(10, state(10, 10))
        mgr.save(20, state(20, 20))
    return commit_references(directory, 30, 20, {"head": state(30, 20)["head"]})


def test_a_step_with_references_is_version_4_and_owns_only_what_changed(tmp_path: Path) -> None:
    manifest = _run(tmp_path)
    body = json.loads((step_dir(tmp_path, 30) / MANIFEST_NAME).read_bytes())
    assert body["version"] == 4 and "tree" in body and "trees" not in body
    refs = {p["path"]: p.get("ref") for p in body["payloads"]}
    assert refs == {"base.w": 20, "base.b": 20, "head": None}
    assert body["info"][base_mark(20)] == cs.CheckpointManager(tmp_path, read_only=True).manifest(20).created
    assert manifest.references == {20} and direct_bases(manifest) == {20}
    assert manifest.stored_nbytes == 16 * 8  # the head alone
    assert manifest.referenced_nbytes == 64 * 32 * 4 + 32 * 8
    assert loads((step_dir(tmp_path, 30) / MANIFEST_NAME).read_bytes()) == manifest


def test_manifests_without_references_keep_their_versions_and_bytes() -> None:
    """No "ref" key, and versions 1 to 3 as before: such manifests are byte for byte what they were."""
    entry = PayloadEntry("w", "numpy", "float32", (2,), "data.bin", 0, 8, "0" * 16, {"id": "raw"})
    tree = {"t": "dict", "keys": ["w"], "vals": [{"t": "array", "id": 0}]}
    one = Manifest(1, 1.5, tree, (entry,), {"data.bin": 8})
    assert dumps(one) == (
        b'{"checksum":"%s","created":1.5,"files":{"data.bin":8},"format":"crashsafe-checkpoint","info":{},'
        b'"metrics":{},"payloads":[{"codec":{"id":"raw"},"dtype":"float32","file":"data.bin","kind":"numpy",'
        b'"nbytes":8,"offset":0,"path":"w","shape":[2],"xxh3":"0000000000000000"}],"step":1,'
        b'"tree":{"keys":["w"],"t":"dict","vals":[{"id":0,"t":"array"}]},"version":1}'
        % json.loads(dumps(one))["checksum"].encode()
    )
    two = dataclasses.replace(one, payloads=(dataclasses.replace(entry, rank=0),))
    assert json.loads(dumps(two))["version"] == 2 and "ref" not in json.loads(dumps(two))["payloads"][0]
    referring = dataclasses.replace(
        two, step=2, payloads=(dataclasses.replace(entry, rank=0, ref=1),), info={base_mark(1): 1.5}
    )
    assert json.loads(dumps(referring))["version"] == 4 and "trees" in json.loads(dumps(referring))


@pytest.mark.parametrize("codec", [None, "zstd"], ids=["raw", "zstd"])
def test_every_reader_reads_through_references(tmp_path: Path, codec: Any) -> None:
    _run(tmp_path, codec)
    expected = state(30, 20)
    reader = cs.CheckpointManager(tmp_path, read_only=True)
    _same(reader.load(30), expected)
    _same(reader.load(), expected)
    _same(reader.load(30, mmap=True), expected)
    live = state(0, 0)
    assert reader.restore(live) == 30
    _same(live, expected)
    report = cs.verify(tmp_path)
    assert report.ok and [s.step for s in report.steps] == [10, 20, 30]
    assert report.steps[2].bases == {20} and report.steps[2].references == {20}
    assert report.steps[2].referenced_bytes == 64 * 32 * 4 + 32 * 8 or codec == "zstd"
    with ChainReader(LocalStore(tmp_path)) as chains:
        entry = next(p for p in chains.manifest(30).payloads if p.path == "base.w")
        at, own = chains.owner(30, entry)
        assert at == 20 and own == dataclasses.replace(entry, ref=None)
        chains.check(30, entry)
        out = np.empty((64, 32), dtype=np.float32)
        assert chains.decode(30, entry, out=out) is out and np.all(out == 20.0)
        assert isinstance(chains.cached(30, entry), bool)


def test_diff_and_export_read_the_referenced_bytes(tmp_path: Path) -> None:
    """diff compares what a restore gets; export writes a file that holds every referenced byte
    (a safetensors file is self-contained whatever the step refers to)."""
    pytest.importorskip("safetensors")
    from safetensors.numpy import load_file

    _run(tmp_path)
    diff = diff_steps(tmp_path, 20, tmp_path, 30)
    assert {p.path: p.status for p in diff.paths} == {
        "base.w": "identical", "base.b": "identical", "head": "differs", "step": "differs",
    }  # fmt: skip
    out = tmp_path.parent / "exported.safetensors"
    export_safetensors(tmp_path, out, step=30)
    tensors = load_file(str(out))
    assert np.all(tensors["base.w"] == 20.0) and np.array_equal(tensors["head"], state(30, 20)["head"])


def test_a_delta_step_referred_to_decodes_through_its_chain(tmp_path: Path) -> None:
    """Step 20 is a delta of step 10; step 30 refers to step 20's delta payloads: they decode
    through step 20's chain, read in place too."""
    _run(tmp_path, INCREMENTAL)
    manifest = cs.CheckpointManager(tmp_path, read_only=True).manifest(30)
    assert {p.path: (p.base, p.ref) for p in manifest.payloads if p.path.startswith("base")} == {
        "base.w": (10, 20), "base.b": (10, 20),
    }  # fmt: skip
    reader = cs.CheckpointManager(tmp_path, read_only=True)
    _same(reader.load(30), state(30, 20))
    live = state(0, 0)
    assert reader.restore(live, step=30) == 30  # a step asked for: every checksum first
    _same(live, state(30, 20))
    assert cs.verify(tmp_path).ok


def _delta_of(directory: Path, step: int, base: int, values: dict[str, np.ndarray[Any, Any]]) -> None:
    """Commit ``step`` with ``values`` as incremental deltas against the same paths of ``base``
    (decoded through its references) and every other payload of ``base`` referred to."""
    store = LocalStore(directory)
    with ChainReader(store) as chains:
        prior = chains.manifest(base)
        writer = StepWriter(store, step)
        payloads = []
        for entry in prior.payloads:
            at, own = chains.owner(base, entry)
            if entry.path not in values:
                payloads.append(dataclasses.replace(own, ref=at))
                continue
            reference = Reference(np.array(chains.decode(base, entry)))
            data, _ = INCREMENTAL.encode_delta(values[entry.path].astype(np.float32), reference)
            put = writer.write_payload(data)
            payloads.append(
                dataclasses.replace(
                    entry, file=put.file, offset=put.offset, nbytes=put.nbytes, xxh3=put.xxh3,
                    codec=INCREMENTAL.get_config(), base=base, ref=None,
                )
            )
        held = {base, *(p.ref for p in payloads if p.ref is not None)}
        info = {**prior.info, **{base_mark(s): chains.manifest(s).created for s in held}}
        manifest = Manifest(step, prior.created + 1, prior.tree, tuple(payloads), writer.files(), {}, info)
        writer.commit(manifest)
    store.close()


def test_a_delta_against_a_step_whose_payload_is_a_reference(tmp_path: Path) -> None:
    """Step 40's base.w is a delta of step 30, whose base.w refers to step 20's bytes (delta of 10):
    the chain runs 10, 20 (through the reference of 30), 40."""
    _run(tmp_path, INCREMENTAL)
    changed = np.full((64, 32), 40.0, dtype=np.float32)
    _delta_of(tmp_path, 40, 30, {"base.w": changed})
    reader = cs.CheckpointManager(tmp_path, read_only=True)
    loaded = reader.load(40, numpy=True)
    assert np.array_equal(loaded["base"]["w"], changed)
    assert np.array_equal(loaded["base"]["b"], np.arange(32.0) + 20)
    with ChainReader(LocalStore(tmp_path)) as chains:
        entry = next(p for p in chains.manifest(40).payloads if p.path == "base.w")
        assert [at for at, _ in chains._chain(40, entry)] == [10, 20, 40]
    assert cs.verify(tmp_path).ok


def test_references_are_kept_by_retention_and_delete_refuses_their_holder(tmp_path: Path) -> None:
    _run(tmp_path)
    with cs.CheckpointManager(tmp_path, keep_last=1) as mgr:
        with pytest.raises(cs.CrashsafeError, match="cannot delete step 20"):
            mgr.delete([20])
        assert mgr.gc() == [10]
        assert mgr.steps() == [20, 30]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _same(cs.CheckpointManager(tmp_path, read_only=True).load(), state(30, 20))


def test_verify_checks_bytes_several_steps_refer_to_once_per_pass(tmp_path: Path) -> None:
    """Steps 30 and 40 both refer to step 20's base: verify reads those bytes once, yet a damaged
    byte there makes every step that refers to them damaged."""
    _run(tmp_path)
    commit_references(tmp_path, 40, 30, {"head": state(40, 20)["head"]})
    reads: list[tuple[int, str]] = []
    original = StepReader.check_stored

    def counting(self: StepReader, entry: PayloadEntry, chunks: Any = None) -> None:
        reads.append((self.step, entry.path))
        original(self, entry, chunks)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StepReader, "check_stored", counting)
        assert cs.verify(tmp_path).ok
    assert reads.count((20, "base.w")) == 1 and (30, "base.w") not in reads
    holder = cs.CheckpointManager(tmp_path, read_only=True).manifest(20)
    w = next(p for p in holder.payloads if p.path == "base.w")
    data = step_dir(tmp_path, 20) / w.file
    raw = bytearray(data.read_bytes())
    raw[w.offset + 5] ^= 0xFF
    data.write_bytes(bytes(raw))
    report = cs.verify(tmp_path)
    assert report.intact == [10]
    for damaged in report.damaged[1:]:
        assert "refers to step 20, which is damaged: checkpoint step 20" in (damaged.problem or "")
        assert "fails its checksum" in (damaged.problem or "")
    with pytest.raises(cs.CorruptCheckpointError, match="refers to step 20, which is damaged: .* fails its"):
        cs.CheckpointManager(tmp_path, read_only=True).load(40, mmap=True)
    live = state(0, 0)
    with pytest.warns(cs.CorruptCheckpointWarning):
        assert cs.CheckpointManager(tmp_path, read_only=True).restore(live) == 10
    _same(live, state(10, 10))


def test_steps_a_read_refers_to_stay_readable_once_opened_though_a_writer_deletes_them(
    tmp_path: Path,
) -> None:
    """open_chains (restore's phase 1) opens the step a payload refers to as well: a writer that
    deletes both steps afterwards cannot take the bytes away mid-read (a local step)."""
    _run(tmp_path)
    store = LocalStore(tmp_path)
    with ChainReader(store) as chains:
        payloads = chains.manifest(30).payloads
        chains.open_chains(30, payloads)
        delete_steps(store, [20, 30])
        assert store.steps() == [10]
        values = {p.path: chains.decode(30, p) for p in payloads}
    assert np.all(values["base.w"] == 20.0) and np.array_equal(values["head"], state(30, 20)["head"])
    store.close()


def test_a_step_asked_for_whose_referenced_bytes_are_damaged_leaves_the_live_state_as_it_was(
    tmp_path: Path,
) -> None:
    """restore(step=30) has nothing to fall back to: every checksum is checked before a byte goes
    into live memory, those of the bytes it refers to (in step 20) too."""
    _run(tmp_path)
    holder = cs.CheckpointManager(tmp_path, read_only=True).manifest(20)
    w = next(p for p in holder.payloads if p.path == "base.w")
    data = step_dir(tmp_path, 20) / w.file
    raw = bytearray(data.read_bytes())
    raw[w.offset + w.nbytes - 1] ^= 0xFF  # the last byte: read after the rest went in, unless checked first
    data.write_bytes(bytes(raw))
    live = state(0, 0)
    damaged = "payload 'base.w' refers to step 20, which is damaged"
    with pytest.raises(cs.CorruptCheckpointError, match=damaged):
        cs.CheckpointManager(tmp_path, read_only=True).restore(live, step=30)
    _same(live, state(0, 0))


class _HostUpload:
    """The calls ``ChainReader.decode(upload=)`` makes of a DeviceUpload, into host memory."""

    def __init__(self, nbytes: int) -> None:
        self.target = np.zeros(nbytes, dtype=np.uint8)

    def fill(self, nbytes: int, read: Any) -> None:
        for at in range(0, nbytes, 1000):
            read(self.target[at : min(at + 1000, nbytes)])

    def put(self, host: np.ndarray[Any, Any]) -> None:
        self.target[:] = np.ascontiguousarray(host).reshape(-1).view(np.uint8)


@pytest.mark.parametrize("codec", [None, "zstd"], ids=["raw", "zstd"])
def test_an_upload_to_device_memory_reads_through_references(tmp_path: Path, codec: Any) -> None:
    """What a CUDA restore does with a reference (tests/gpu/test_cuda_references.py on a GPU): raw
    bytes streamed from the step holding them, checksummed as they land; others decoded, then put."""
    _run(tmp_path, codec)
    with ChainReader(LocalStore(tmp_path)) as chains:
        entry = next(p for p in chains.manifest(30).payloads if p.path == "base.w")
        upload = _HostUpload(64 * 32 * 4)
        chains.decode(30, entry, upload=upload)  # type: ignore[arg-type]
        assert np.all(upload.target.view(np.float32) == 20.0)


def test_verify_remembers_per_step_not_per_payload_what_a_pass_verified(tmp_path: Path) -> None:
    """Verification streams: what a pass remembers to check shared bytes once grows with the steps it
    verified, not with every payload of each (a store of many steps of many tensors)."""
    arrays = {f"model.layers.{k}.self_attn.q_proj.weight": np.full(2, float(k)) for k in range(300)}
    with cs.CheckpointManager(tmp_path, keep_last=None, async_save=False) as mgr:
        mgr.save(0, arrays)
    for step in range(1, 80):  # the same bytes as step 0, under other step numbers
        shutil.copytree(step_dir(tmp_path, 0), step_dir(tmp_path, step))
        resign(tmp_path, step, lambda body, step=step: body.update(step=step))  # type: ignore[misc]
    held: dict[int, int] = {}

    def note(report: cs.StepReport) -> None:
        held[report.step] = tracemalloc.get_traced_memory()[0]

    tracemalloc.start()
    try:
        assert len(cs.verify(tmp_path, progress=note).intact) == 80
    finally:
        tracemalloc.stop()
    assert held[79] - held[39] < 1 << 19  # 40 more steps of 300 payloads: not 12,000 parts remembered
