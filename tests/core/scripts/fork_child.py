"""What a spawned child of tests/core/test_fork.py runs (a fresh interpreter imports it by name)."""

from pathlib import Path

import numpy as np

import crashsafe as cs


def save_own(directory: Path, async_save: bool) -> None:
    """Save 8 MB with a manager of this process's own."""
    with cs.CheckpointManager(directory, async_save=async_save) as mgr:
        mgr.save(1, {"w": np.arange(1 << 20, dtype=np.float64)})
