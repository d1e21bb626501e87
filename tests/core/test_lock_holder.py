"""A second writer in the same process is told what in this process holds the directory and how to
release it (it was told "another CheckpointManager (pid <its own pid>)")."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import crashsafe as cs
from crashsafe.storage.lock import held_by


def test_a_second_writer_in_the_same_process_is_told_where_the_first_was_opened(tmp_path: Path) -> None:
    first = cs.CheckpointManager(tmp_path)
    holder = rf"in this very process \(pid {os.getpid()}\): a CheckpointManager opened at "
    with pytest.raises(cs.LockedError, match=holder + re.escape(f"{__file__}:") + r"\d+ and not closed"):
        cs.CheckpointManager(tmp_path)
    with pytest.raises(cs.LockedError, match=r"call its close\(\)"):
        cs.CheckpointManager(tmp_path)
    first.close()
    cs.CheckpointManager(tmp_path).close()  # released: the note went with the lock


def test_an_integration_names_itself_and_how_to_release(tmp_path: Path) -> None:
    with held_by("the CrashsafeThing of a Trainer; call thing.release() to release it"):
        first = cs.CheckpointManager(tmp_path)
    try:
        with pytest.raises(cs.LockedError, match=r"the CrashsafeThing of a Trainer; call thing.release\(\)"):
            cs.CheckpointManager(tmp_path)
    finally:
        first.close()
