"""Growing the world: a checkpoint of 2 FSDP2 ranks restored by 4, each rank reading only the chunks
of the saved shards that hold its part (format version 3), verified, and falling back with the
others when a chunk it reads is damaged."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

import crashsafe as cs
from crashsafe.format.manifest import CHUNKED_VERSION, MANIFEST_NAME, REFERENCES_VERSION
from crashsafe.loading import array_ids
from crashsafe.storage.layout import step_dir

from ..refsteps import commit_references

# A hidden layer 4096 wide: its weight's saved shards are 64 KiB, in 16 chunks of 4 KiB each
WIDE = {"JOB_WIDTH": "4096", "JOB_CHUNK_BYTES": "4096"}


def _same(a: Path, b: Path) -> None:
    with np.load(a) as left, np.load(b) as right:
        assert sorted(left.files) == sorted(right.files)
        for name in left.files:
            assert np.array_equal(left[name], right[name]), name


def _saved_by_two(launch: Any, tmp_path: Path) -> Path:
    """Steps 3 and 6 of a wide FSDP2 job on 2 ranks; its final state in two.npz."""
    directory = tmp_path / "two"
    args = ("fsdp", directory, 6, 3, tmp_path / "two.npz", 60)
    assert launch("job.py", 2, *args, env_of={0: WIDE, 1: WIDE}).wait() == [0, 0]
    return directory


def _lines(ranks: Any) -> list[dict[str, Any]]:
    lines = [json.loads(proc.stdout.readline()) for proc, _ in ranks.procs if proc.stdout is not None]
    assert ranks.wait() == [0] * len(lines)
    return lines


def test_four_ranks_read_their_share_of_two_ranks_shards_bit_identically(tmp_path: Path, launch: Any) -> None:
    """Restored by 4 ranks, the state of 2 is bit-identical, and each rank reads from the files
    (counted as the store layer serves them) only what it holds now plus the unsharded payloads of
    its tree: about half of the saved shards it meets, where reading them whole read twice that."""
    directory = _saved_by_two(launch, tmp_path)
    env = dict.fromkeys(range(4), WIDE)
    lines = _lines(launch("reshard.py", 4, directory, tmp_path / "four", tmp_path / "four.npz", env_of=env))
    _same(tmp_path / "two.npz", tmp_path / "four.npz")
    manifest = cs.CheckpointManager(directory, read_only=True).manifest(6)
    shards = [p for p in manifest.payloads if p.shard is not None]
    assert sum(line["held"] for line in lines) == sum(p.nbytes for p in shards)  # the ranks split them
    for rank, line in enumerate(lines):
        used = [manifest.payloads[i] for i in array_ids(manifest.tree_of(rank))]
        unsharded = sum(p.nbytes for p in used if p.shard is None)  # RNG states, AdamW's step counts
        assert line["held"] > 0
        assert line["held"] + unsharded <= line["read"] <= line["held"] + unsharded + 2 * 4096, (rank, line)
    body = json.loads((step_dir(directory, 6) / MANIFEST_NAME).read_text())
    assert body["version"] == CHUNKED_VERSION
    assert all(p.chunks is not None and p.chunks.size == 4096 for p in shards)


def test_four_ranks_read_their_share_through_references_to_two_ranks_shards(
    tmp_path: Path, launch: Any
) -> None:
    """Step 9 refers to every payload of step 6 (format version 4, as an unchanged state is saved):
    4 ranks restore it bit-identically, each reading from step 6's files only the chunks of the
    saved shards that hold its part, as they would of step 6 itself."""
    directory = _saved_by_two(launch, tmp_path)
    commit_references(directory, 9, 6)
    assert json.loads((step_dir(directory, 9) / MANIFEST_NAME).read_text())["version"] == REFERENCES_VERSION
    env = dict.fromkeys(range(4), WIDE)
    lines = _lines(launch("reshard.py", 4, directory, tmp_path / "four", tmp_path / "four.npz", env_of=env))
    _same(tmp_path / "two.npz", tmp_path / "four.npz")
    manifest = cs.CheckpointManager(directory, read_only=True).manifest(9)
    assert manifest.stored_nbytes == 0 and manifest.references == {6}
    for rank, line in enumerate(lines):
        used = [manifest.payloads[i] for i in array_ids(manifest.tree_of(rank))]
        unsharded = sum(p.nbytes for p in used if p.shard is None)
        assert line["held"] + unsharded <= line["read"] <= line["held"] + unsharded + 2 * 4096, (rank, line)
    assert cs.verify(directory).ok


def test_a_damaged_chunk_that_one_of_four_ranks_reads_makes_every_rank_fall_back(
    tmp_path: Path, launch: Any
) -> None:
    """A byte flipped in the file, inside the saved shard of rank 1 where the rows of rank 3 of 4
    lie: rank 3 alone reads that chunk, and all four ranks restore step 3 together (in place,
    into live tensors), ending exactly as a restore of step 3 alone."""
    directory = _saved_by_two(launch, tmp_path)
    env = dict.fromkeys(range(4), WIDE)

    def restore(out: str, *step: int) -> list[int]:
        lines = _lines(launch("inplace.py", 4, directory, tmp_path / out, *step, env_of=env))
        return [line["step"] for line in lines]

    assert restore("three.npz", 3) == [3] * 4
    manifest = cs.CheckpointManager(directory, read_only=True).manifest(6)
    (weight,) = [p for p in manifest.payloads if p.path == "model.0.weight" and p.rank == 1]
    assert weight.shard == ((4096, 8), (2048, 0)) and weight.chunks is not None
    at = weight.offset + weight.nbytes * 3 // 4 + 100  # row 3072 + 3 of 4096: rank 3's (rows 3072..4095)
    data = step_dir(directory, 6) / weight.file
    raw = bytearray(data.read_bytes())
    raw[at] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert restore("fell.npz") == [3] * 4
    _same(tmp_path / "three.npz", tmp_path / "fell.npz")
    logs = [log.read_text() for log in tmp_path.glob("rank*.log")]
    warned = [w for log in logs for w in re.findall(r"skipping damaged.*", log)]
    assert len(warned) == 4  # every rank says why it fell back: rank 3 found the damage, no other
    assert all(re.findall(r"\brank (\d+): ", w) == ["3"] and "model.0.weight" in w for w in warned)
    assert [(s.step, s.ok) for s in cs.verify(directory).steps] == [(3, True), (6, False)]
