"""Names inside a checkpoint directory, and which entries are committed steps.

``step_<12 digits>/`` is a committed step; ``.tmp-*`` is a save in progress (or torn by a crash);
``.trash-*`` is a step being deleted. Only committed steps are ever read.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "LOCK_NAME",
    "TMP_PREFIX",
    "TRASH_PREFIX",
    "committed_steps",
    "fsync_dir",
    "leftovers",
    "step_dir",
    "step_name",
]

LOCK_NAME = ".lock"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
_STEP = re.compile(r"^step_(\d{12})$")


def step_name(step: int) -> str:
    return f"step_{step:012d}"


def step_dir(root: Path, step: int) -> Path:
    return root / step_name(step)


def committed_steps(root: Path) -> list[int]:
    """Committed steps under ``root``, ascending (empty if ``root`` does not exist)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _STEP.match(n)))


def leftovers(root: Path) -> list[Path]:
    """Torn saves and half-deleted steps that a writer may remove."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(root / n for n in names if n.startswith((TMP_PREFIX, TRASH_PREFIX)))


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
