"""Chunk checksums of raw shards (format version 3): written in one hashing pass, validated like
every other field, and read back over only the chunks that hold the part a reader asks for."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import crashsafe as cs
from crashsafe.chain import ChainReader
from crashsafe.distributed.saving import CHUNK_BYTES, ReplicaPlanner
from crashsafe.distributed.shards import fill_from, flat_span, read_range, read_sharded
from crashsafe.format.chunks import Chunks, chunk_span, combine, hash_chunks
from crashsafe.format.manifest import (
    CHUNKED_VERSION,
    DISTRIBUTED_VERSION,
    MANIFEST_NAME,
    Manifest,
    PayloadEntry,
    dumps,
    loads,
)
from crashsafe.state.inplace import Box, Destination
from crashsafe.state.tree import ArrayLeaf, Shard
from crashsafe.storage.base import Store, StoredFile
from crashsafe.storage.local import LocalStore
from crashsafe.storage.mapped import MappedFile
from crashsafe.storage.stores import open_store
from crashsafe.storage.writer import StepWriter

from .test_hostile_manifest import signed

CHUNK = 4096
GLOBAL = (64, 1024)  # float32: two shards of 32 rows, 128 KiB and 32 chunks each
ARRAY = np.random.default_rng(0).standard_normal(GLOBAL).astype(np.float32)

# ------------------------------------------------------------------------------------- writing


def test_chunk_checksums_are_the_chunks_xxh3_and_combine_to_the_payload_checksum() -> None:
    data = np.arange(10_000, dtype=np.uint8).tobytes()
    chunks = hash_chunks(data, CHUNK)
    assert chunks.xxh3 == tuple(xxhash.xxh3_64_hexdigest(data[i : i + CHUNK]) for i in (0, 4096, 8192))
    joined = b"".join(xxhash.xxh3_64(data[i : i + CHUNK]).digest() for i in (0, 4096, 8192))
    assert chunks.combined() == xxhash.xxh3_64_hexdigest(joined)
    assert hash_chunks(b"", CHUNK).combined() == xxhash.xxh3_64_hexdigest(b"")  # an empty shard


def _write(store: Store, step: int, array: np.ndarray[Any, Any], *, chunked: bool = True) -> Manifest:
    """Commit ``array`` as a distributed step of two row shards (ranks 0 and 1), hashed in chunks."""
    writer = StepWriter(store, step)
    payloads, trees = [], []
    for rank, rows in enumerate((slice(0, 32), slice(32, 64))):
        put = writer.write_payload(np.ascontiguousarray(array[rows]).data, chunk=CHUNK if chunked else None)
        entry = PayloadEntry(
            "w", "numpy", "float32", (32, 1024), put.file, put.offset, put.nbytes, put.xxh3,
            {"id": "raw"}, None, rank, (GLOBAL, (rows.start, 0)), put.chunks,
        )  # fmt: skip
        payloads.append(entry)
        trees.append({"t": "dict", "keys": ["w"], "vals": [{"t": "array", "id": rank}]})
    manifest = Manifest(step, 1.0, trees[0], tuple(payloads), writer.files(), rank_trees=(trees[1],))
    writer.commit(manifest)
    return manifest


def test_a_step_with_chunks_is_version_3_and_one_without_stays_version_2(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, create=True)
    for step, chunked, version in ((1, False, DISTRIBUTED_VERSION), (2, True, CHUNKED_VERSION)):
        written = _write(store, step, ARRAY, chunked=chunked)
        body = json.loads((tmp_path / f"step_{step:012d}" / MANIFEST_NAME).read_text())
        assert body["version"] == version
        assert loads(dumps(written)) == written
    assert [len(p.chunks.xxh3) for p in written.payloads if p.chunks] == [32, 32]


def test_a_digest_the_caller_computed_is_not_computed_again(tmp_path: Path) -> None:
    writer = StepWriter(LocalStore(tmp_path, create=True), 1)
    given_chunks = Chunks(CHUNK, ("0" * 16,))  # not these bytes' digests: kept as given, unread
    assert writer.write_payload(b"x" * 100, given_chunks, CHUNK).chunks is given_chunks
    with pytest.raises(ValueError, match="needs its chunks"):
        writer.write_payload(b"x", "0" * 16, CHUNK)
    writer.abort()


# ------------------------------------------------------------------------------ where to read

shapes = st.lists(st.integers(1, 9), min_size=1, max_size=4).map(tuple)


@st.composite
def regions(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    shape = draw(shapes)
    where = []
    for n in shape:
        start = draw(st.integers(0, n - 1))
        where.append(slice(start, draw(st.integers(start + 1, n))))
    return shape, tuple(where)


@settings(max_examples=300, deadline=None)
@given(region=regions(), itemsize=st.sampled_from([1, 2, 4, 8, 16]), size=st.sampled_from([16, 32, 256]))
def test_the_chunks_read_cover_the_region_and_no_more(
    region: tuple[tuple[int, ...], tuple[slice, ...]], itemsize: int, size: int
) -> None:
    """flat_span runs from the region's first element to its last (C order); chunk_span covers
    those bytes with whole chunks, the first and last of which hold a byte of them."""
    shape, where = region
    flat = np.arange(int(np.prod(shape))).reshape(shape)[where].ravel()
    first, stop = flat_span(shape, where)
    assert (first, stop) == (flat[0], flat[-1] + 1)
    start, end = first * itemsize, stop * itemsize
    lo, hi = chunk_span(start, end, size)
    assert lo * size <= start < (lo + 1) * size and (hi - 1) * size < end <= hi * size


# --------------------------------------------------------------------------------- reading


@pytest.fixture(params=["local", "memory"])
def step(request: Any, tmp_path_factory: Any) -> Iterator[tuple[Store, Manifest]]:
    """Step 1 of ARRAY in two chunked shards: in a local directory (read through a mapping) or in
    fsspec's memory store (read through ranged reads of the store)."""
    if request.param == "local":
        store: Store = LocalStore(tmp_path_factory.mktemp("chunks"), create=True)
    else:
        store = open_store(f"memory://crashsafe-chunks-{time.time_ns()}/run", create=True)
    yield store, _write(store, 1, ARRAY)
    store.close()


@contextmanager
def counting() -> Iterator[list[tuple[int, int]]]:
    """The file ranges read meanwhile: every byte a step reader takes from a store goes through a
    mapped file's populate or a stored file's read_into."""
    ranges: list[tuple[int, int]] = []
    with pytest.MonkeyPatch.context() as patch:
        populate = MappedFile.populate
        patch.setattr(MappedFile, "populate", lambda f, o, n: (ranges.append((o, o + n)), populate(f, o, n)))
        for cls in StoredFile.__subclasses__():
            read = cls.read_into
            counted = lambda f, v, o, r=read: (ranges.append((o, o + len(v))), r(f, v, o))  # noqa: E731
            patch.setattr(cls, "read_into", counted)
        yield ranges


boxes = st.tuples(st.integers(0, 63), st.integers(1, 64), st.integers(0, 1023), st.integers(1, 1024)).map(
    lambda t: ((t[0], t[2]), (min(t[1], 64 - t[0]), min(t[3], 1024 - t[2])))
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(box=boxes)
def test_any_box_reads_only_the_chunks_holding_it(step: tuple[Store, Manifest], box: Box) -> None:
    """What fill_from copies is the box of the saved array, and of each shard it meets it read the
    chunks from the one holding the box's first element there to the one holding its last."""
    store, manifest = step
    into = Destination(None, np.zeros(box[1], dtype=np.float32), box)
    rows = slice(box[0][0], box[0][0] + box[1][0])
    cols = slice(box[0][1], box[0][1] + box[1][1])
    with ChainReader(store) as chains:
        for part in manifest.payloads:
            assert part.shard is not None
            top = part.shard[1][0]
            inside = slice(max(rows.start, top) - top, min(rows.stop, top + 32) - top)
            with counting() as ranges:
                fill_from(chains, 1, part, into)
            if inside.start >= inside.stop:
                assert ranges == []
                continue
            first = int(np.ravel_multi_index((inside.start, cols.start), part.shape)) * 4
            last = int(np.ravel_multi_index((inside.stop - 1, cols.stop - 1), part.shape)) * 4 + 4
            want = (first - first % CHUNK, min(-(-last // CHUNK) * CHUNK, part.nbytes))
            if (inside.start, inside.stop, cols.start, cols.stop) == (0, 32, 0, 1024):
                want = (0, part.nbytes)  # all of the shard: read whole, every byte verified
            assert read_range(part, into) == (first, last)
            assert [(start - part.offset, stop - part.offset) for start, stop in ranges] == [want]
    assert np.array_equal(into.out, ARRAY[rows, cols])


def _flip(store: Store, part: PayloadEntry, at: int) -> None:
    """Flip the byte ``at`` of a payload in its stored file (a local directory's)."""
    assert isinstance(store, LocalStore)
    path = store.root.path / "step_000000000001" / part.file
    raw = bytearray(path.read_bytes())
    raw[part.offset + at] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_damage_is_found_in_the_chunks_read_and_by_a_whole_read(tmp_path: Path) -> None:
    """A flipped byte in chunk 20 of rank 1's shard (its row 20: a row is a chunk): a box that reads
    it raises CorruptCheckpointError naming that chunk's bytes; one that does not reads intact;
    reading the whole array, checking the payload and verifying the step all find it."""
    store = LocalStore(tmp_path, create=True)
    manifest = _write(store, 1, ARRAY)
    part = manifest.payloads[1]
    _flip(store, part, 20 * CHUNK + 100)
    damaged = f"{part.file} bytes {part.offset + 20 * CHUNK}..{part.offset + 21 * CHUNK} are damaged"
    with ChainReader(store) as chains:
        other = Destination(None, np.zeros((4, 1024), np.float32), ((32 + 12, 0), (4, 1024)))
        fill_from(chains, 1, part, other)  # rows 12..15 of the shard: chunks 12..15
        assert np.array_equal(other.out, ARRAY[44:48])
        hit = Destination(None, np.zeros((1, 8), np.float32), ((32 + 20, 0), (1, 8)))
        with pytest.raises(cs.CorruptCheckpointError, match=damaged):
            fill_from(chains, 1, part, hit)
        with pytest.raises(cs.CorruptCheckpointError, match=damaged):
            fill_from(chains, 1, part, hit, verify_only=True)
        with pytest.raises(cs.CorruptCheckpointError, match=damaged):
            read_sharded(chains, manifest, part, None, numpy=True)
        with pytest.raises(cs.CorruptCheckpointError, match=damaged):
            chains.check(1, part)
    assert not cs.verify(tmp_path).ok


# ------------------------------------------------------------------------------ validation


def test_a_re_signed_wrong_chunk_digest_is_found_when_that_chunk_is_read(tmp_path: Path) -> None:
    """A forger who rewrites a chunk's digest and the payload checksum to match, and re-signs: the
    manifest loads, the other chunks read intact, that chunk fails, and verify reports the step."""
    store = LocalStore(tmp_path, create=True)
    _write(store, 1, ARRAY)
    path = tmp_path / "step_000000000001" / MANIFEST_NAME
    body = json.loads(path.read_text())
    entry = body["payloads"][0]
    entry["chunks"]["xxh3"][5] = "0123456789abcdef"
    entry["xxh3"] = combine(entry["chunks"]["xxh3"])
    path.write_bytes(signed(body))
    with ChainReader(store) as chains:
        part = chains.manifest(1).payloads[0]
        fine = Destination(None, np.zeros((8, 1024), np.float32), ((8, 0), (8, 1024)))  # chunks 8..15
        fill_from(chains, 1, part, fine)
        assert np.array_equal(fine.out, ARRAY[8:16])
        hit = Destination(None, np.zeros((1, 1024), np.float32), ((5, 0), (1, 1024)))
        with pytest.raises(cs.CorruptCheckpointError, match="fails its checksum"):
            fill_from(chains, 1, part, hit)
    assert not cs.verify(tmp_path).ok


class _Twin:
    """Rank 0 of two whose peer holds exactly what it holds (a replicated DTensor's twin)."""

    rank, world, leader, shared = 0, 2, True, True

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        return [obj, obj]


def test_a_shard_other_ranks_hold_alike_is_hashed_in_chunks_once_to_plan(tmp_path: Path) -> None:
    """An array several ranks hold alike is hashed to plan, and that hash is its raw payload's
    checksum: for a shard, its chunk checksums, so its bytes are not hashed again to be written."""
    shard = np.arange(3 << 20, dtype=np.float32)  # 12 MiB: 3 chunks
    plain = np.arange(10, dtype=np.int64)
    leaves = [
        ArrayLeaf("w", "torch", "float32", shard.shape, shard, Shard((6 << 20,), (0,))),
        ArrayLeaf("n", "numpy", "int64", plain.shape, plain),
    ]
    arrays = [shard, plain]
    planner = ReplicaPlanner(_Twin())  # type: ignore[arg-type]
    plan = planner.plan(leaves, lambda i: arrays[i], LocalStore(tmp_path, create=True))
    assert plan.digests[0] == hash_chunks(shard.data, CHUNK_BYTES) and CHUNK_BYTES == 4 << 20
    assert plan.digests[1] == xxhash.xxh3_64_hexdigest(plain.data)
