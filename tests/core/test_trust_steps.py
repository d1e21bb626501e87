"""Steps that must never be silently lost: the whole int64 step range, delta chains after a save
below an earlier step, deletions killed halfway, readers racing a deleting writer, and verify
agreeing with load."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

import crashsafe as cs
from crashsafe.format.chunks import MIN_CHUNK_BYTES
from crashsafe.format.manifest import MANIFEST_NAME, PART_KEY, Manifest, PayloadEntry, dumps
from crashsafe.storage.layout import committed_steps, step_dir
from crashsafe.storage.local import LocalStore
from crashsafe.storage.writer import StepWriter

from ..hostile import stop
from .conftest import child_env

INCREMENTAL = cs.codecs.Incremental(full_every=4)


def _state(step: int) -> dict[str, Any]:
    return {"w": np.full(256, float(step)), "n": np.arange(32) * step, "step": step}


def _assert_is(state: dict[str, Any], step: int) -> None:
    assert state["step"] == step
    assert np.all(state["w"] == float(step)) and np.array_equal(state["n"], np.arange(32) * step)


def _every_step_loads(directory: Path) -> list[int]:
    report = cs.verify(directory)
    assert report.ok, [d.problem for d in report.damaged]
    reader = cs.CheckpointManager(directory, read_only=True)
    for step in report.intact:
        _assert_is(reader.load(step), step)
    return report.intact


# ----------------------------------------------------------------------------- the step range


@pytest.mark.parametrize("codec", [None, INCREMENTAL])
def test_any_int64_step_is_listed_restored_verified_and_retained(tmp_path: Path, codec: Any) -> None:
    big = [10**12, 1_700_000_000_000_123, 2**63 - 1]  # a millisecond timestamp, a nanosecond one, the top
    with cs.CheckpointManager(tmp_path, keep_last=3, codec=codec) as mgr:
        for step in [5, *big]:
            mgr.save(np.uint64(step) if step == 2**63 - 1 else step, _state(step % 1000))
        mgr.wait()
        # retention orders steps as numbers: step 5 goes, unless the delta chain still needs it
        assert mgr.steps() == (big if codec is None else [5, *big])
        assert mgr.latest_step() == 2**63 - 1
    live = _state(0)
    assert cs.CheckpointManager(tmp_path, read_only=True).restore(live) == 2**63 - 1
    _assert_is(live, (2**63 - 1) % 1000)
    assert cs.verify(tmp_path).intact[-3:] == big


@pytest.mark.parametrize("step", [2**63, -1, 1.0, True, "3"])
def test_a_step_out_of_range_is_refused_at_save(tmp_path: Path, step: Any) -> None:
    """A crashsafe error (it was a bare ValueError), still caught by ``except ValueError``."""
    refused = pytest.raises(cs.InvalidArgumentError, match=r"whole number from 0 to 2\*\*63 - 1")
    with cs.CheckpointManager(tmp_path) as mgr, refused as caught:
        mgr.save(step, _state(1))
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, cs.CrashsafeError)
    assert committed_steps(tmp_path) == []


def test_a_non_canonical_step_name_is_not_a_step(tmp_path: Path) -> None:
    with cs.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, _state(1))
    (tmp_path / "step_000000000001").rename(tmp_path / "step_0000000000001")  # 13 digits, leading 0
    assert committed_steps(tmp_path) == []


# ----------------------------------------------------------------------------- delta chains


@pytest.mark.parametrize("codec", [INCREMENTAL, cs.codecs.LC(bits=3)])
def test_a_save_below_an_earlier_step_starts_a_new_chain(tmp_path: Path, codec: Any) -> None:
    with cs.CheckpointManager(tmp_path, keep_last=None, codec={"w": codec}) as mgr:
        for step in (10, 11, 5, 6, 12):
            mgr.save(step, _state(step))
    reader = cs.CheckpointManager(tmp_path, read_only=True)
    assert reader.manifest(5).payloads[0].base is None  # full: 10 and 11 are not earlier than 5
    assert reader.manifest(6).payloads[0].base == 5
    assert cs.verify(tmp_path).intact == [5, 6, 10, 11, 12]
    for step in (5, 6, 10, 11, 12):
        assert reader.load(step)["step"] == step


def test_retention_keeps_a_step_saved_below_the_newest(tmp_path: Path) -> None:
    with cs.CheckpointManager(tmp_path, keep_last=1, async_save=False) as mgr:
        mgr.save(10, _state(10))
        mgr.save(5, _state(5))  # a rewound run: the step just saved is not deleted by its own retention
        assert mgr.steps() == [5, 10]
        mgr.save(6, _state(6))
        assert mgr.steps() == [6, 10]


def test_rewinding_by_deleting_later_steps_never_deltas_against_them(tmp_path: Path) -> None:
    """What the parameter server does after a rollback: delete the steps after it, save on."""
    with cs.CheckpointManager(tmp_path, keep_last=None, codec=INCREMENTAL) as mgr:
        for step in range(1, 9):
            mgr.save(step, _state(step))
        mgr.delete([6, 7, 8])
        mgr.save(9, _state(9))
        mgr.wait()
        assert mgr.steps() == [1, 2, 3, 4, 5, 9]
    assert _every_step_loads(tmp_path) == [1, 2, 3, 4, 5, 9]


def test_delete_refuses_a_base_that_a_kept_step_needs(tmp_path: Path) -> None:
    with cs.CheckpointManager(tmp_path, keep_last=None, codec=INCREMENTAL) as mgr:
        for step in range(1, 4):
            mgr.save(step, _state(step))
        with pytest.raises(cs.CrashsafeError, match="cannot delete step 2"):
            mgr.delete([2])
        assert mgr.steps() == [1, 2, 3]


# ----------------------------------------------------------------------------- killed deletions


@pytest.fixture(scope="module")
def delta_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 steps of delta chains (a full save every 4th), none deleted."""
    directory = tmp_path_factory.mktemp("delta") / "template"
    with cs.CheckpointManager(directory, keep_last=None, codec=INCREMENTAL) as mgr:
        for step in range(16):
            mgr.save(step, _state(step))
    return directory


@pytest.mark.timeout(120)
def test_sigkill_during_gc_never_strands_a_delta(tmp_path: Path, delta_run: Path) -> None:
    """gc deletes steps 0..11 (14 and 15 stay, with their bases 12, 13). Kill it for real at a
    random one of its deletions, at both points of the deletion protocol: every step left must
    verify and load; the next gc finishes the job."""
    rng = random.Random(7)
    aims = rng.sample([(p, n) for p in ("after_trash_rename", "mid_delete") for n in range(1, 13)], 12)
    for point, nth in aims:
        directory = tmp_path / f"{point}-{nth}"
        subprocess.run(["cp", "-a", str(delta_run), str(directory)], check=True)
        result = subprocess.run(
            [sys.executable, "-m", "crashsafe.cli", "gc", str(directory), "--keep-last", "2"],
            env=child_env(CRASHSAFE_KILL_AT=f"{point}:{nth}"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == -signal.SIGKILL, result.stderr
        left = _every_step_loads(directory)
        assert len(left) == 16 - nth + (point == "mid_delete") - 1 or len(left) == 16 - nth
        assert {12, 13, 14, 15} <= set(left)
        with cs.CheckpointManager(directory, keep_last=2) as mgr:
            mgr.gc()
        assert _every_step_loads(directory) == [12, 13, 14, 15]


# ----------------------------------------------------------------------------- racing readers


@pytest.mark.timeout(120)
def test_a_reader_racing_a_deleting_writer_always_gets_a_whole_step(
    tmp_path: Path, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    """On tmpfs (fsync is free there) the writer commits and deletes steps faster than the reader
    reads one: steps vanish under the reader all the time."""
    shm = Path("/dev/shm")
    directory = Path(tempfile.mkdtemp(dir=shm if shm.is_dir() else tmp_path))
    writer = spawn("delta_writer.py", directory)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        reader = cs.CheckpointManager(directory, read_only=True)
        loads, steps = 0, set()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a CorruptCheckpointWarning would be a false alarm
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                state = reader.load()
                for i in range(16):
                    assert np.all(state[f"w{i}"] == float(state["step"])), "a torn mix of two steps"
                assert np.all(state["b"] == state["step"])
                loads += 1
                steps.add(state["step"])
        assert loads > 100 and len(steps) > 20  # it really raced many of the writer's steps
    finally:
        stop(writer)
        shutil.rmtree(directory)


# ----------------------------------------------------------------------------- verify == load


def _resign(directory: Path, step: int, edit: Callable[[dict[str, Any]], None]) -> None:
    path = step_dir(directory, step) / MANIFEST_NAME
    body = json.loads(path.read_bytes())
    body.pop("checksum")
    edit(body)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    body["checksum"] = xxhash.xxh3_64_hexdigest(canonical)
    path.write_bytes(json.dumps(body).encode())


def test_verify_decodes_what_load_decodes(tmp_path: Path) -> None:
    """A payload swapped for another valid zstd frame, with its checksum and the manifest re-signed:
    every checksum matches, but it does not decode to its declared shape."""
    import zstandard

    with cs.CheckpointManager(tmp_path, keep_last=None, codec="zstd") as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    data = step_dir(tmp_path, 2) / "data.bin"
    frame = zstandard.ZstdCompressor().compress(b"\0" * 100)
    entry = {}

    def swap(body: dict[str, Any]) -> None:
        entry.update(body["payloads"][0])
        body["payloads"][0].update(
            offset=body["files"]["data.bin"], nbytes=len(frame), xxh3=xxhash.xxh3_64_hexdigest(frame)
        )
        body["files"]["data.bin"] += len(frame)

    _resign(tmp_path, 2, swap)
    with open(data, "ab") as f:
        f.write(frame)
    reader = cs.CheckpointManager(tmp_path, read_only=True)
    with pytest.raises(cs.CorruptCheckpointError, match="zstd"):
        reader.load(2)
    report = cs.verify(tmp_path)
    assert report.intact == [1] and "zstd" in (report.damaged[0].problem or "")


@pytest.mark.timeout(120)
def test_verify_streams_raw_payloads(tmp_path: Path) -> None:
    """Verifying a 128 MiB raw step grows the verifier's peak RSS by far less than 128 MiB."""
    with cs.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"big": np.ones(16 << 20, dtype=np.float64)})
    code = (
        "import resource, sys, crashsafe as cs\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "assert cs.verify(sys.argv[1]).ok\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=child_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(out.stdout) < 40 * 1024, f"verify grew RSS by {int(out.stdout) // 1024} MiB"


def test_a_path_that_changes_kind_starts_a_new_chain(tmp_path: Path) -> None:
    """Found by the round-trip property test: a numpy 0-d array saved, then a numpy scalar at the
    same path (same dtype and shape, another kind) must not become a delta of it."""
    with cs.CheckpointManager(tmp_path, keep_last=None, codec=INCREMENTAL) as mgr:
        mgr.save(0, {"a": np.array(False)})
        mgr.save(1, {"a": np.bool_(True)})
    reader = cs.CheckpointManager(tmp_path, read_only=True)
    assert reader.manifest(1).payloads[0].base is None
    assert reader.load(1)["a"] is np.True_ and reader.load(0)["a"].shape == ()


# ----------------------------------------------------------------------------- distributed steps

ROWS = 2  # rows of the (4, 8) float32 array "w" each of two ranks holds


def _two_ranks(
    directory: Path, chunked: bool, trees: Any = None, same: bool = False
) -> Manifest:
    """Commit step 1 as two ranks of a distributed manager would: each saved its half of "w"
    (a shard, with chunk checksums in format version 3) and its own "mine" (the same values with
    ``same``), or ``trees`` over payloads 0..3 (w, w, mine, mine); return its manifest."""
    store = LocalStore(directory, create=True)
    writer = StepWriter(store, 1)
    payloads = []
    for rank in (0, 1):
        half = np.full((ROWS, 8), float(rank + 1), dtype=np.float32)
        put = writer.write_payload(half.data, chunk=MIN_CHUNK_BYTES if chunked else None)
        where = (put.file, put.offset, put.nbytes, put.xxh3, {"id": "raw"})
        shard = ((2 * ROWS, 8), (rank * ROWS, 0))
        entry = PayloadEntry("w", "numpy", "float32", half.shape, *where, None, rank, shard, put.chunks)
        payloads.append(entry)
    for rank in (0, 1):
        mine = np.full(4, 10.0 if same else float(rank + 10))
        put = writer.write_payload(mine.data)
        where = (put.file, put.offset, put.nbytes, put.xxh3, {"id": "raw"})
        payloads.append(PayloadEntry("mine", "numpy", "float64", (4,), *where, None, rank))
    if trees is None:
        trees = (_tree([0, 2]), _tree([1, 3]))
    manifest = Manifest(1, time.time(), trees[0], tuple(payloads), writer.files(), rank_trees=(trees[1],))
    writer.commit(manifest)
    store.close()
    return manifest


@pytest.mark.parametrize("chunked", [False, True], ids=["v2", "v3"])
@pytest.mark.parametrize("forgery", ["overlap", "gap"])
def test_verify_refuses_shards_that_load_refuses(tmp_path: Path, chunked: bool, forgery: str) -> None:
    """Re-signed shards of one array that overlap, or leave a gap in, its global shape: load
    refused the step, and verify called it intact."""
    manifest = _two_ranks(tmp_path, chunked, same=True)
    version = json.loads((step_dir(tmp_path, 1) / MANIFEST_NAME).read_bytes())["version"]
    assert version == (3 if chunked else 2)
    payloads = list(manifest.payloads)
    if forgery == "overlap":  # rank 1's half moved up by a row: rows 1..2 twice, row 3 nowhere
        payloads[1] = dataclasses.replace(payloads[1], shard=((2 * ROWS, 8), (ROWS - 1, 0)))
    else:  # both halves of a larger array: row 2 nowhere
        payloads[:2] = [dataclasses.replace(p, shard=((2 * ROWS + 1, 8), p.shard[1])) for p in payloads[:2]]
        payloads[1] = dataclasses.replace(payloads[1], shard=((2 * ROWS + 1, 8), (ROWS + 1, 0)))
    forged = dataclasses.replace(manifest, payloads=tuple(payloads))
    (step_dir(tmp_path, 1) / MANIFEST_NAME).write_bytes(dumps(forged))  # signed anew
    with pytest.raises(cs.CorruptCheckpointError, match="do not tile"):
        cs.CheckpointManager(tmp_path, read_only=True).load(1)
    report = cs.verify(tmp_path)
    assert report.intact == [] and "do not tile its global shape" in (report.damaged[0].problem or "")


def test_a_distributed_step_labelled_a_memory_part_still_has_its_shards_tiled(tmp_path: Path) -> None:
    """A memory part's shards cover only its rank's boxes (Manifest.partial), but a step of many
    ranks is never one part: labelled one (memory.part), a gap in its shards is still found."""
    manifest = _two_ranks(tmp_path, False, same=True)
    payloads = [dataclasses.replace(p, shard=((2 * ROWS + 1, 8), p.shard[1])) for p in manifest.payloads[:2]]
    payloads[1] = dataclasses.replace(payloads[1], shard=((2 * ROWS + 1, 8), (ROWS + 1, 0)))
    forged = dataclasses.replace(
        manifest, payloads=(*payloads, *manifest.payloads[2:]), info={PART_KEY: "0/2"}
    )
    (step_dir(tmp_path, 1) / MANIFEST_NAME).write_bytes(dumps(forged))  # signed anew
    with pytest.raises(cs.CorruptCheckpointError, match="do not tile"):
        cs.CheckpointManager(tmp_path, read_only=True).load(1)
    report = cs.verify(tmp_path)
    assert report.intact == [] and "do not tile its global shape" in (report.damaged[0].problem or "")


@pytest.mark.parametrize("chunked", [False, True], ids=["v2", "v3"])
def test_verify_and_load_agree_on_intact_shards(tmp_path: Path, chunked: bool) -> None:
    _two_ranks(tmp_path, chunked, same=True)
    assert cs.verify(tmp_path).intact == [1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the ranks saved one state: nothing to warn about
        loaded = cs.CheckpointManager(tmp_path, read_only=True).load(1, numpy=True)
    assert np.array_equal(loaded["w"], np.repeat([1.0, 2.0], ROWS * 8).reshape(2 * ROWS, 8))


def _tree(ids: list[int], **ints: int) -> dict[str, Any]:
    """A rank's tree: "w" and "mine" (payloads ``ids``) and python ints."""
    vals = [{"t": "array", "id": i} for i in ids] + [{"t": "int", "v": str(v)} for v in ints.values()]
    return {"t": "dict", "keys": ["w", "mine", *ints], "vals": vals}


@pytest.mark.parametrize(
    "trees, said",
    [
        (None, "rank 1 saved its own values of 'mine'"),
        ((_tree([0, 2], step=1), _tree([1, 3], step=1, epoch=0)), "rank 1 saved other keys or python values"),
        ((_tree([0, 2], step=1), _tree([1, 3], step=2)), "rank 1 saved other keys or python values"),
    ],
    ids=["own-values", "more-keys", "other-python-value"],
)
def test_a_plain_load_of_ranks_that_saved_different_states_says_so(
    tmp_path: Path, trees: Any, said: str
) -> None:
    """One process loading a step whose ranks saved different trees got rank 0's, silently."""
    _two_ranks(tmp_path, True, trees, same=trees is not None)
    reader = cs.CheckpointManager(tmp_path, read_only=True)
    for read in (reader.load, lambda: reader.load(1, mmap=True), lambda: reader.restore(_live_half())):
        with pytest.warns(cs.CrashsafeWarning, match=f"saved by 2 ranks, and {said}.*returns rank 0's"):
            read()
    assert cs.verify(tmp_path).intact == [1]


def _live_half() -> dict[str, Any]:
    return {"w": np.zeros((2 * ROWS, 8), dtype=np.float32), "mine": np.zeros(4)}
