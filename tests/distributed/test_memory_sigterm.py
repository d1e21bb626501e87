"""The memory tier and SIGTERM across ranks: the save that follows a preemption notice goes to the
persistent tier on every rank, even where the ranks hear the signal at different moments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from crashsafe.storage.layout import committed_steps


def test_ranks_hearing_sigterm_apart_persist_the_same_save(tmp_path: Path, launch: Any) -> None:
    ranks = launch("memory_sigterm.py", 2, tmp_path / "disk", tmp_path / "mem", 15)
    outs = [proc.communicate(timeout=120)[0] for proc, _ in ranks.procs]
    assert ranks.wait() == [0, 0]
    assert [out.strip().splitlines()[-1] for out in outs] == ["exit 143", "exit 143"], outs
    assert committed_steps(tmp_path / "disk") == [3]  # the preempted job's last save, on disk
