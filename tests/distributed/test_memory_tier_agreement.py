"""Ranks of a memory tier that meet different things act alike: the save that follows a preemption
notice goes to the persistent tier on every rank, even where the ranks hear SIGTERM at different
moments; a live state one rank cannot take fails every rank's restore at once."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from tests.hostile import make_victim, untouched

from crashsafe.storage.layout import committed_steps


def test_ranks_hearing_sigterm_apart_persist_the_same_save(tmp_path: Path, launch: Any) -> None:
    ranks = launch("memory_sigterm.py", 2, tmp_path / "disk", tmp_path / "mem", 15)
    outs = [proc.communicate(timeout=120)[0] for proc, _ in ranks.procs]
    assert ranks.wait() == [0, 0]
    assert [out.strip().splitlines()[-1] for out in outs] == ["exit 143", "exit 143"], outs
    assert committed_steps(tmp_path / "disk") == [3]  # the preempted job's last save, on disk


def test_a_live_state_one_rank_cannot_take_fails_every_rank_at_once(tmp_path: Path, launch: Any) -> None:
    """A rank whose live state does not fit its memory part raises its error; the others hear it and
    raise too, naming it, instead of waiting for that rank until the coordination timeout."""
    ranks = launch("memory_mismatch.py", 2, tmp_path / "disk", tmp_path / "mem", 60)
    outs = [proc.communicate(timeout=120)[0].strip() for proc, _ in ranks.procs]
    assert ranks.wait() == [0, 0]
    assert outs[1].startswith("UnsupportedStateError"), outs
    assert not outs[0].startswith("CoordinationError") and "rank 1" in outs[0] and "shape" in outs[0], outs
    assert committed_steps(tmp_path / "mem" / "a" / "rank_0") == [1, 2]  # nothing deleted: not damage


def test_a_peer_sending_another_part_is_not_restored(tmp_path: Path, launch: Any) -> None:
    """Host a lost its memory; rank 0 pulls its part from rank 1, which sends its own part instead
    (labelled as such: memory.part "1/2"). Rank 0 never takes it for its own: no step is restored
    from it, and every rank says why."""
    saved = launch("memory_forged_part.py", 2, tmp_path / "disk", tmp_path / "mem", "save")
    assert saved.wait() == [0, 0]
    shutil.rmtree(tmp_path / "mem" / "a")
    ranks = launch("memory_forged_part.py", 2, tmp_path / "disk", tmp_path / "mem", "restore")
    outs = [proc.communicate(timeout=120)[0].strip() for proc, _ in ranks.procs]
    assert ranks.wait() == [0, 0]
    assert all(out.startswith("CorruptCheckpointError") and "1/2" in out for out in outs), outs


def test_the_step_a_restart_resumed_from_is_kept_until_a_newer_one_has_its_copies(
    tmp_path: Path, launch: Any
) -> None:
    """keep_last=1, restarted from step 3; step 4's copy of rank 0's part fails on host b. Step 3,
    the newest step with all its copies, must stay: with host a lost, it is the step left."""
    args = (tmp_path / "disk", tmp_path / "mem")
    assert launch("memory_retention.py", 2, *args, "save").wait() == [0, 0]
    resumed = launch("memory_retention.py", 2, *args, "resume")
    assert [p.communicate(timeout=120)[0].strip() for p, _ in resumed.procs] == ["restored 3"] * 2
    assert resumed.wait() == [0, 0]
    shutil.rmtree(tmp_path / "mem" / "a")  # host a lost its memory
    restored = launch("memory_retention.py", 2, *args, "restore")
    assert [p.communicate(timeout=120)[0].strip() for p, _ in restored.procs] == ["restored 3"] * 2
    assert restored.wait() == [0, 0]


def test_parts_of_one_step_number_from_two_timelines_are_not_restored_together(
    tmp_path: Path, launch: Any
) -> None:
    """Run 0 saves steps 1-2 (2 persistent), run 1 steps 3-4 (4 too). Run 2, its ranks on other hosts
    (as an elastic launcher may place them), goes back to step 2 and saves its own step 3: the stores
    run 2 does not hold keep run 1's 3-4. Run 3, placed as run 1, must restore one run's step 3 on
    every rank, never rank 1's part of run 1 beside the others' of run 2."""
    args = (tmp_path / "disk", tmp_path / "mem")

    def restart(hosts: str, run: int, saves: int, *step: int) -> list[str]:
        ranks = launch("memory_timelines.py", 3, *args, hosts, run, saves, *step)
        outs = [p.communicate(timeout=120)[0].strip() for p, _ in ranks.procs]
        assert ranks.wait() == [0, 0, 0], outs
        return outs

    assert restart("a,b,c", 0, 2) == ["restored 0 0"] * 3  # (nothing saved yet: fresh)
    assert restart("a,b,c", 1, 2) == ["restored 2 0"] * 3
    assert restart("a,c,b", 2, 1, 2) == ["restored 2 0"] * 3
    assert restart("a,b,c", 3, 0) == ["restored 3 2"] * 3


def test_a_part_store_one_rank_refuses_fails_every_rank_at_once(tmp_path: Path, launch: Any) -> None:
    """Rank 1's part store is a link (refused: rule 11); rank 0 hears it and fails too, naming it,
    instead of waiting for rank 1 in the peers' group until the coordination timeout."""
    victim = make_victim(tmp_path / "victim")
    (tmp_path / "mem" / "b").mkdir(parents=True)
    os.symlink(victim, tmp_path / "mem" / "b" / "rank_1")
    ranks = launch("memory_refused.py", 2, tmp_path / "disk", tmp_path / "mem", 60)
    outs = [proc.communicate(timeout=120)[0].strip() for proc, _ in ranks.procs]
    assert ranks.wait() == [0, 0]
    assert outs[1].startswith("StorageError") and "rank_1" in outs[1], outs
    assert outs[0].startswith("StorageError") and "rank 1" in outs[0] and "rank_1" in outs[0], outs
    assert int(outs[0].split()[1]) < 30, outs
    untouched(victim)


def test_a_memory_save_one_rank_fails_fails_every_rank_at_once(tmp_path: Path, launch: Any) -> None:
    """Rank 1 cannot commit its part (its RAM disk full): rank 0 hears why at once, instead of
    waiting for rank 1's copies until the coordination timeout and blaming a dead rank."""
    ranks = launch("memory_save_fails.py", 2, tmp_path / "disk", tmp_path / "mem", 60)
    outs = [proc.communicate(timeout=180)[0].strip() for proc, _ in ranks.procs]
    assert ranks.wait() == [0, 0]
    assert all(out.startswith("StorageError") and "No space left" in out for out in outs), outs
    assert "rank 1" in outs[0] and int(outs[0].split()[1]) < 30, outs


def test_an_own_copy_damaged_after_the_listing_is_pulled_again(tmp_path: Path, launch: Any) -> None:
    """Rank 0's own copy of step 3 is damaged between the listing and the restore (its manifest):
    rank 0 leaves the restore in step with the others, its copy is pulled again from rank 1, and
    every rank restores its own part of step 3."""
    args = (tmp_path / "disk", tmp_path / "mem")
    assert launch("memory_swapped.py", 2, *args, "save").wait() == [0, 0]
    ranks = launch("memory_swapped.py", 2, *args, "restore")
    outs = [proc.communicate(timeout=120)[0].strip() for proc, _ in ranks.procs]
    assert ranks.wait() == [0, 0], outs
    assert outs == ["restored 3 30.0", "restored 3 31.0"], outs
