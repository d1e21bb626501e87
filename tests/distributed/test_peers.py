"""Memory-tier parts copied rank to rank (crashsafe.distributed.peers) over real gloo on 127.0.0.1,
3 ranks, each a real process with its own "host memory" directory: a ring of copies that load back
equal; a damaged source byte, a forged manifest and a step with references each refused with a
clear message while the other transfers go through; another save of the step replaced, the very
same save kept; a rank SIGKILLed or hung, and the others answer within the group's timeout."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crashsafe as cs
from crashsafe.copying import copy_step
from crashsafe.distributed.peers import Transfer, _check
from crashsafe.errors import InvalidArgumentError
from crashsafe.storage.layout import step_dir
from crashsafe.storage.local import LocalStore

from ..refsteps import commit_references

TIMEOUT = 5.0


def _store(root: Path, holder: int, owner: int) -> Path:
    return root / f"mem{holder}" / f"rank_{owner}"


def _save(directory: Path, step: int, seed: int) -> dict[str, Any]:
    """A part as the memory tier saves it: one process, raw, owning all its bytes."""
    rng = np.random.default_rng(seed)
    state = {
        "w": rng.standard_normal((64, 33)).astype(np.float32),
        "b": rng.integers(0, 9, 100),
        "step": step,
    }
    with cs.CheckpointManager(directory, keep_last=None, unchanged=False) as mgr:
        mgr.save(step, state)
    manifest = cs.CheckpointManager(directory, read_only=True).manifest(step)
    assert all(p.ref is None and p.base is None for p in manifest.payloads)
    return state


def _flip(path: Path) -> None:
    """Flip one bit of a byte in the middle of ``path`` (a payload's byte)."""
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(raw))


def _load(directory: Path, step: int) -> dict[str, Any]:
    loaded: dict[str, Any] = cs.CheckpointManager(directory, read_only=True).load(step, numpy=True)
    return loaded


def _equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert sorted(a) == sorted(b)
    for key, value in a.items():
        assert np.array_equal(value, b[key]), key


def _run(launch: Any, root: Path, transfers: list[list[int]], mode: str = "") -> dict[int, dict[str, Any]]:
    """The report of each rank but rank 2 where it dies or hangs (then killed once the others end)."""
    ranks = launch("peers.py", 3, root, TIMEOUT, json.dumps(transfers), mode)
    reporting = [0, 1] if mode in ("die", "hang") else [0, 1, 2]
    reports = {}
    for rank in reporting:
        out = ranks.procs[rank][0].stdout
        assert out is not None
        lines = out.read().strip().splitlines()  # (until the rank exits)
        if lines:
            reports[rank] = json.loads(lines[-1])
    ranks.kill([2] if mode else [])
    codes = ranks.wait(60)
    assert [codes[rank] for rank in reporting] == [0] * len(reporting), codes
    return reports


def _outcome(report: dict[str, Any]) -> dict[tuple[int, ...], str | None]:
    return {tuple(t): message for t, message in report["outcome"]}


def test_a_ring_of_copies_with_damage_forgery_references_and_earlier_saves(
    tmp_path: Path, launch: Any
) -> None:
    root = tmp_path / "run"
    parts = {(r, s): _save(_store(root, r, r), s, 10 * r + s) for r in range(3) for s in (5, 6)}
    parts[(0, 8)] = _save(_store(root, 0, 0), 8, 8)
    commit_references(_store(root, 1, 1), 7, 6)  # a step that refers to step 6's bytes
    _flip(step_dir(_store(root, 0, 0), 5) / "data.bin")  # rank 0's own step 5 is damaged
    _save(_store(root, 2, 1), 5, 99)  # rank 2 holds another save of rank 1's step 5
    for holder in (1, 0):  # ranks 1 and 0 hold the very save of rank 2's step 5 already
        source, target = LocalStore(_store(root, 2, 2)), LocalStore(_store(root, holder, 2), create=True)
        copy_step(source, target, 5)
        source.close()
        target.close()
    _flip(step_dir(_store(root, 0, 2), 5) / "data.bin")  # rank 0's copy of it is damaged
    kept = (step_dir(_store(root, 1, 2), 5) / "data.bin").stat()
    transfers = [
        [0, 5, 0, 1],  # damaged at the source
        [0, 6, 0, 1],  # then the same pair goes on
        [1, 5, 1, 2],  # replaces another save
        [2, 5, 2, 0],  # replaces the very same save, damaged
        [2, 5, 2, 1],  # the very same save is there, intact
        [1, 7, 1, 0],  # references: refused
        [1, 9, 1, 0],  # no such step
        [0, 8, 0, 2],  # forged on the way: refused by the target
        [0, 6, 0, 2],  # then the same pair goes on
    ]
    reports = _run(launch, root, transfers, "forge")
    assert sorted(reports) == [0, 1, 2]
    seen: dict[tuple[int, ...], str | None] = {}
    for rank, report in reports.items():
        outcome = _outcome(report)
        assert sorted(outcome) == sorted(tuple(t) for t in transfers if rank in t[2:])
        for t, message in outcome.items():  # both ends tell the same story
            assert seen.setdefault(t, message) == message, (t, seen[t], message)
    assert "fails its checksum" in str(seen[(0, 5, 0, 1)]) and "did not send" in str(seen[(0, 5, 0, 1)])
    assert "must own all its bytes" in str(seen[(1, 7, 1, 0)])
    assert "did not send step 9" in str(seen[(1, 9, 1, 0)]) and "not committed" in str(seen[(1, 9, 1, 0)])
    assert "refused" in str(seen[(0, 8, 0, 2)]) and "checksum mismatch" in str(seen[(0, 8, 0, 2)])
    done = [(0, 6, 0, 1), (1, 5, 1, 2), (2, 5, 2, 0), (2, 5, 2, 1), (0, 6, 0, 2)]
    assert all(seen[t] is None for t in done), seen
    for owner, step, _, holder in done:
        _equal(_load(_store(root, holder, owner), step), parts[(owner, step)])
        assert cs.verify(_store(root, holder, owner)).ok
    now = (step_dir(_store(root, 1, 2), 5) / "data.bin").stat()
    assert (now.st_ino, now.st_ctime_ns) == (kept.st_ino, kept.st_ctime_ns)  # kept, not written again
    for holder, owner, step in [
        (1, 0, 5),
        (0, 1, 7),
        (0, 1, 9),
        (2, 0, 8),
    ]:  # nothing committed, nothing left over
        store = LocalStore(_store(root, holder, owner), create=True)
        assert step not in store.steps() and store.leftovers() == []
        store.close()


@pytest.mark.parametrize("mode", ["die", "hang"])
def test_a_rank_that_dies_or_hangs_leaves_the_others_answering_within_the_timeout(
    tmp_path: Path, launch: Any, mode: str
) -> None:
    root = tmp_path / "run"
    parts = {r: _save(_store(root, r, r), 5, r) for r in range(3)}
    ring = [[r, 5, r, (r + 1) % 3] for r in range(3)]
    started = time.monotonic()
    reports = _run(launch, root, ring, mode)
    assert sorted(reports) == [0, 1]
    assert time.monotonic() - started < 40
    for report in reports.values():
        assert report["seconds"] < TIMEOUT + 2
    outcome = {**_outcome(reports[0]), **_outcome(reports[1])}
    assert outcome[(0, 5, 0, 1)] is None  # between the living ranks
    _equal(_load(_store(root, 1, 0), 5), parts[0])
    for t in [(1, 5, 1, 2), (2, 5, 2, 0)]:
        assert "rank 2 did not answer within 5 s" in str(outcome[t]), outcome[t]
    store = LocalStore(_store(root, 0, 2), create=True)
    assert store.steps() == [] and store.leftovers() == []
    store.close()


@pytest.mark.parametrize(
    ("transfers", "match"),
    [
        ([Transfer(0, 5, 0, 3)], "not a Transfer of a step .* group of 3"),
        ([Transfer(0, -1, 0, 1)], "not a Transfer of a step"),
        ([(0, 5, 0, 1)], "not a Transfer"),
        ([Transfer(0, 5, 1, 1)], "sends to its own source"),
        ([Transfer(0, 5, 0, 1), Transfer(0, 5, 2, 1)], "one part to one rank twice"),
        (
            [Transfer(0, 5, 0, 1), Transfer(0, 5, 1, 2)],
            "rank 1 would send step 5 of rank 0's part while it receives",
        ),
    ],
)
def test_transfers_no_rank_could_run_are_refused_alike_everywhere(transfers: list[Any], match: str) -> None:
    """(Each rank checks the same list before any message: every rank raises, none waits.)"""
    with pytest.raises(InvalidArgumentError, match=match):
        _check(transfers, 3, 0)
    _check([Transfer(0, 5, 0, 1), Transfer(0, 5, 0, 2), Transfer(1, 5, 1, 0)], 3, 2)


@pytest.mark.parametrize("sizes", [[5, 0, 17, 3], [40], [0], [], [16, 16], [1, 30, 1]])
def test_a_part_sent_from_its_staged_bytes_travels_in_the_wires_chunks(
    monkeypatch: pytest.MonkeyPatch, sizes: list[int]
) -> None:
    """The messages a rank sends of a part it just committed, made from its staged arrays (views
    where a chunk lies in one array, copies where it spans several), are the very bytes and chunks
    a read of the committed step would send; arrays that are not the payloads' bytes are refused."""
    import numpy as np

    from crashsafe.distributed import peers
    from crashsafe.format.manifest import Manifest, PayloadEntry

    monkeypatch.setattr(peers, "_CHUNK", 16)
    rng = np.random.default_rng(len(sizes))
    arrays = [rng.integers(0, 255, n, dtype=np.uint8) for n in sizes]
    entries = tuple(
        PayloadEntry(f"a{i}", "numpy", "uint8", (n,), "data.bin", 0, n, "0" * 16, {"id": "raw"})
        for i, n in enumerate(sizes)
    )
    manifest = Manifest(1, 0.0, {}, entries, {"data.bin": sum(sizes)}, {}, {})
    sent = peers._in_memory(manifest, arrays)
    assert sent is not None
    body, pieces = sent
    whole = b"".join(a.tobytes() for a in arrays)
    assert [int(p.numel()) for p in pieces] == [b - a for a, b in peers._chunks(len(whole))]
    assert b"".join(p.numpy().tobytes() for p in pieces) == whole
    assert body == peers.dumps(manifest)
    if sizes:
        assert (
            peers._in_memory(manifest, [*arrays[:-1], arrays[-1][:-1]] if sizes[-1] else arrays[:-1]) is None
        )
