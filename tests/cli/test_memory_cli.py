"""``crashsafe ls`` and ``verify`` of a memory tier's directory: one table of its steps (which parts
the directory holds, whether complete), every part's steps verified, exit 1 on a damaged, misplaced
or skipped part; a ``rank_<r>`` that is a link is never followed, one that is a FIFO never blocks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.hostile import make_victim, untouched, within

import crashsafe as cs
import crashsafe.manager
import crashsafe.memory_tier
from crashsafe.memory_tier import MemoryParts, MemoryTier

from .conftest import check_json, first_column, invoke_here


class _Pretend:
    """The coordination of rank ``rank`` of ``world`` processes, as MemoryParts sees it: every rank
    runs on this host (so each part has one copy, its own), and nothing is exchanged."""

    leader = False

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        return [obj] * self.world


def _save(disk: Path, tier: MemoryTier, steps: range) -> None:
    with cs.CheckpointManager(disk, memory=tier) as mgr:
        for step in steps:
            mgr.save(step, {"w": np.full(64, step, np.float32), "step": step}, {"loss": 1.0 / step})


def _save_as(
    rank: int, world: int, tmp: Path, steps: range, monkeypatch: pytest.MonkeyPatch, timeline: str = "job"
) -> None:
    """Save ``steps`` into the memory directory ``tmp/mem`` as rank ``rank`` of ``world``: a real
    manager whose memory tier is told it is that rank (``memory.part`` "rank/world") of ``timeline``."""
    monkeypatch.setattr(
        crashsafe.manager, "MemoryParts", lambda tier, _: MemoryParts(tier, _Pretend(rank, world))
    )
    monkeypatch.setattr(crashsafe.memory_tier, "_token", lambda: timeline)
    _save(
        tmp / f"disk{rank}-{world}", MemoryTier(tmp / "mem", persist_every=100, copies=1, keep_last=3), steps
    )


@pytest.fixture
def two_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A memory directory of a job of 2 ranks: ``rank_0`` and ``rank_1``, steps 1 to 3."""
    for rank in (0, 1):
        _save_as(rank, 2, tmp_path, range(1, 4), monkeypatch)
    return tmp_path / "mem"


def _flip(data: Path) -> None:
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(raw)


def test_a_real_memory_tier_is_listed_and_verified(tmp_path: Path) -> None:
    mem = tmp_path / "mem"
    _save(tmp_path / "disk", MemoryTier(mem, persist_every=3), range(1, 6))
    listed = invoke_here("ls", str(mem))
    assert listed.code == 0, listed.err
    rows = first_column(listed.out, "step")
    assert [(step, rest[:4]) for step, rest in rows] == [
        (s, ["0", "of", "1", "complete"]) for s in ("4", "5")
    ]
    assert all("ok" in rest for _, rest in rows)
    doc = check_json(invoke_here("ls", str(mem), "--json").out, "ls")
    assert [(s["step"], s["world"], s["parts"], s["complete"], s["ok"]) for s in doc["steps"]] == [
        (4, 1, [0], True, True), (5, 1, [0], True, True)
    ]  # fmt: skip
    (store,) = doc["stores"]  # step 3, the last deleted, is kept for the next save to write over
    assert store["spare"].startswith(".trash-step_000000000003-")
    assert store | {"spare": None} == {
        "name": "rank_0",
        "rank": 0,
        "problem": None,
        "leftovers": [],
        "spare": None,
    }
    assert doc["steps"][1]["copies"][0]["claims"] == "0/1" and doc["steps"][1]["copies"][0]["metrics"] == {
        "loss": 0.2
    }
    verified = invoke_here("verify", str(mem))
    assert verified.code == 0 and "all 2 part steps intact, in 1 part stores" in verified.out
    alone = invoke_here("verify", str(mem / "rank_0"))  # the part store as a plain directory
    assert alone.code == 0 and "torn save" not in alone.out, alone.out
    assert f"{store['spare']} (a deleted step's files, or one a memory store keeps" in " ".join(
        alone.out.split()
    )
    assert check_json(invoke_here("verify", str(mem), "--json").out, "verify")["ok"]


def test_two_parts_complete_then_a_flipped_byte_is_named(two_parts: Path) -> None:
    doc = check_json(invoke_here("ls", str(two_parts), "--json").out, "ls")
    assert [(s["step"], s["parts"], s["world"], s["complete"]) for s in doc["steps"]] == [
        (1, [0, 1], 2, True), (2, [0, 1], 2, True), (3, [0, 1], 2, True)
    ]  # fmt: skip
    assert "0,1 of 2" in invoke_here("ls", str(two_parts)).out
    _flip(two_parts / "rank_1" / "step_000000000002" / "data.bin")
    verified = invoke_here("verify", str(two_parts))
    assert verified.code == 1 and "1 of 6 part steps damaged" in verified.err
    assert "DAMAGED rank_1 step 2:" in verified.out and "checksum" in verified.out
    doc = check_json(invoke_here("verify", str(two_parts), "--json").out, "verify")
    assert not doc["ok"] and [(c["store"], c["step"]) for c in doc["steps"] if not c["ok"]] == [("rank_1", 2)]
    step2 = check_json(invoke_here("ls", str(two_parts), "--json").out, "ls")["steps"][1]
    assert (step2["parts"], step2["complete"], step2["ok"]) == ([0], False, False)
    assert step2["problems"][0].startswith("rank_1: ")


def test_a_part_in_another_ranks_store_is_misplaced(two_parts: Path) -> None:
    (two_parts / "rank_1").rename(two_parts / "rank_3")
    verified = invoke_here("verify", str(two_parts))
    assert verified.code == 1 and "3 of 6 part steps damaged, misplaced or foreign" in verified.err
    assert "PROBLEM rank_3 step 1: misplaced: its manifest says it is part 1/2" in verified.out
    doc = check_json(invoke_here("ls", str(two_parts), "--json").out, "ls")
    assert all((s["parts"], s["complete"], s["ok"]) == ([0], False, False) for s in doc["steps"])
    assert all(
        c["claims"] == "1/2" and "misplaced" in c["problem"] for s in doc["steps"] for c in s["copies"][1:]
    )


def test_parts_of_jobs_of_different_sizes_are_not_one_step(
    two_parts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save_as(0, 2, tmp_path, range(4, 5), monkeypatch)
    _save_as(1, 4, tmp_path, range(4, 5), monkeypatch)  # another job's rank 1 saved step 4 here
    step4 = check_json(invoke_here("ls", str(two_parts), "--json").out, "ls")["steps"][-1]
    assert (step4["step"], step4["world"], step4["parts"], step4["complete"], step4["ok"]) == (
        4,
        None,
        [0, 1],
        False,
        False,
    )
    assert "jobs of different sizes (rank_0 0/2, rank_1 1/4)" in step4["problems"][0]
    assert "0 of 2, 1 of 4" in invoke_here("ls", str(two_parts)).out


def test_a_linked_part_store_is_reported_never_followed(two_parts: Path, tmp_path: Path) -> None:
    victim = make_victim(tmp_path / "victim")
    (two_parts / "rank_1").rename(tmp_path / "elsewhere")
    (two_parts / "rank_1").symlink_to(tmp_path / "elsewhere")  # another run's part: not this directory's
    (two_parts / "rank_2").symlink_to(victim)
    listed = invoke_here("ls", str(two_parts))
    assert listed.code == 0, listed.err
    assert (
        "skipped rank_1:" in listed.out and "symbolic link" in listed.out and "skipped rank_2:" in listed.out
    )
    doc = check_json(invoke_here("ls", str(two_parts), "--json").out, "ls")
    assert all((s["parts"], s["complete"]) == ([0], False) for s in doc["steps"])
    assert [s["problem"] is not None for s in doc["stores"]] == [False, True, True]
    verified = invoke_here("verify", str(two_parts), "--json")
    assert verified.code == 1 and "2 of 3 part stores skipped" in verified.err
    assert all(c["store"] == "rank_0" for c in check_json(verified.out, "verify")["steps"])
    untouched(victim)
    assert sorted(os.listdir(tmp_path / "elsewhere")) == [
        ".lock",
        *(f"step_00000000000{s}" for s in (1, 2, 3)),
    ]


def test_a_fifo_named_as_a_part_store_never_blocks(two_parts: Path) -> None:
    os.mkfifo(two_parts / "rank_2")
    listed = within(20, lambda: invoke_here("ls", str(two_parts)))
    assert listed.code == 0 and "skipped rank_2:" in listed.out and "FIFO" in listed.out
    verified = within(20, lambda: invoke_here("verify", str(two_parts)))
    assert verified.code == 1 and "1 of 3 part stores skipped" in verified.err


def test_other_folders_and_one_part_store_read_as_before(two_parts: Path, tmp_path: Path) -> None:
    part = invoke_here("ls", str(two_parts / "rank_1"), "--json")  # a part store is an ordinary store
    assert [s["step"] for s in check_json(part.out, "ls")["steps"]] == [1, 2, 3]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "rank.txt").write_text("not a part store")
    assert "no committed checkpoints in" in invoke_here("ls", str(tmp_path / "notes")).out
    missing = invoke_here("verify", str(tmp_path / "nope"))
    assert missing.code == 2 and "does not exist" in missing.err
    shown = invoke_here("show", str(two_parts))
    assert (
        shown.code == 2 and "memory tier's directory" in shown.err and str(two_parts / "rank_0") in shown.err
    )
    refused = invoke_here("ls", str(two_parts), "--metric", "loss")
    assert refused.code == 2 and "--metric apply to a store" in refused.err


def test_parts_of_two_timelines_are_not_listed_as_one_complete_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1's part of step 3 saved by another timeline (a run that went back and saved step 3
    again): not one step, as the memory tier's recovery judges it."""
    for rank in (0, 1):
        _save_as(rank, 2, tmp_path, range(1, 4 - rank), monkeypatch)
    _save_as(1, 2, tmp_path, range(3, 4), monkeypatch, timeline="later")
    doc = check_json(invoke_here("ls", str(tmp_path / "mem"), "--json").out, "ls")
    assert [(s["step"], s["complete"], s["ok"]) for s in doc["steps"]] == [
        (1, True, True), (2, True, True), (3, False, False)
    ]  # fmt: skip
    assert "different timelines" in doc["steps"][2]["problems"][0]
