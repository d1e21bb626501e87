"""A distributed step whose shards refer to an earlier step's (format version 4, the ranks' layout,
chunk checksums copied): assembled whole, cut to another layout's box reading only the chunks that
hold it (resharding), restored in place and verified through its references; a reference whose
shard, rank or chunk checksums differ from the holder's is damage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crashsafe as cs
from crashsafe.chain import ChainReader
from crashsafe.distributed.shards import fill_from
from crashsafe.format.chunks import combine
from crashsafe.format.manifest import MANIFEST_NAME, REFERENCES_VERSION
from crashsafe.state.inplace import Destination
from crashsafe.storage.layout import step_dir
from crashsafe.storage.local import LocalStore
from crashsafe.storage.reader import StepReader

from ..refsteps import Body, commit_references, resign
from .test_trust_steps import ROWS, _live_half, _two_ranks

WHOLE = np.repeat([1.0, 2.0], ROWS * 8).reshape(2 * ROWS, 8).astype(np.float32)


@pytest.fixture
def referring(tmp_path: Path) -> Path:
    """Step 1 of two ranks (raw shards of w with chunk checksums); step 2 refers to all of it."""
    _two_ranks(tmp_path, chunked=True, same=True)
    commit_references(tmp_path, 2, 1)
    return tmp_path


def test_the_shards_of_a_step_with_references_read_through_them(referring: Path) -> None:
    body = json.loads((step_dir(referring, 2) / MANIFEST_NAME).read_bytes())
    assert body["version"] == REFERENCES_VERSION and len(body["trees"]) == 2
    assert all(p["ref"] == 1 and ("chunks" in p) == (p["path"] == "w") for p in body["payloads"])
    reader = cs.CheckpointManager(referring, read_only=True)
    assert np.array_equal(reader.load(2, numpy=True)["w"], WHOLE)
    assert np.array_equal(reader.load(2, mmap=True)["w"], WHOLE)
    live = _live_half()
    assert reader.restore(live, step=2) == 2 and np.array_equal(live["w"], WHOLE)
    assert cs.verify(referring).intact == [1, 2]


def test_resharding_reads_only_the_chunks_of_the_step_referred_to(referring: Path) -> None:
    """A box of rows 1..2 (of 4), as a rank of another layout holds it: each saved shard it meets is
    cut from the chunks holding its part, in step 1's file, verified; nothing is read of step 2's."""
    read: list[tuple[int, str, Any]] = []
    stored = StepReader.read_stored

    def counting(self: StepReader, entry: Any, chunks: Any = None) -> Any:
        read.append((self.step, entry.path, chunks))
        return stored(self, entry, chunks)

    with ChainReader(LocalStore(referring)) as chains, pytest.MonkeyPatch.context() as patch:
        patch.setattr(StepReader, "read_stored", counting)
        manifest = chains.manifest(2)
        box = ((1, 0), (2, 8))
        into = Destination(None, np.zeros((2, 8), dtype=np.float32), box)
        for part in (p for p in manifest.payloads if p.path == "w"):
            fill_from(chains, 2, part, into, verify_only=True)
            fill_from(chains, 2, part, into)
        assert np.array_equal(into.out, WHOLE[1:3])
        first = next(p for p in manifest.payloads if p.path == "w")
        assert np.array_equal(chains.span(2, first, 8, 8), WHOLE[1])
    assert read and all(step == 1 and path == "w" and chunks == (0, 1) for step, path, chunks in read)


def _first_w(body: Body) -> dict[str, Any]:
    entry = next(p for p in body["payloads"] if p["path"] == "w")
    assert isinstance(entry, dict)
    return entry


def _chunk(body: Body) -> None:
    entry = _first_w(body)
    entry["chunks"]["xxh3"][0] = "0123456789abcdef"
    entry["xxh3"] = combine(entry["chunks"]["xxh3"])


def _swap_shards(body: Body) -> None:
    """The two halves of w swapped between the ranks: they still tile w, but neither rank's shard
    is the part the holder's entry of that rank holds."""
    halves = [p for p in body["payloads"] if p["path"] == "w"]
    halves[0]["shard"]["offset"], halves[1]["shard"]["offset"] = [ROWS, 0], [0, 0]


FORGED = {
    "other chunk checksums": (_chunk, "which holds it with another xxh3, chunks"),
    "swapped shards": (_swap_shards, "which does not hold this part"),
    "another rank": (lambda body: _first_w(body).update(rank=1), "which does not hold this part"),
}


@pytest.mark.parametrize("name", FORGED)
def test_a_shard_reference_that_differs_from_its_holder_is_damage(referring: Path, name: str) -> None:
    edit, message = FORGED[name]
    resign(referring, 2, edit)
    with pytest.raises(cs.CorruptCheckpointError, match=message):
        cs.CheckpointManager(referring, read_only=True).load(2)
    with pytest.warns(cs.CorruptCheckpointWarning):
        live = _live_half()
        assert cs.CheckpointManager(referring, read_only=True).restore(live) == 1
    assert np.array_equal(live["w"], WHOLE) and cs.verify(referring).intact == [1]
