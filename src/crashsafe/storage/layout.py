"""Names inside a checkpoint directory, and which entries are committed steps.

``step_<n>/`` (n zero-padded to at least 12 digits, any int64 step) is a committed step; ``.tmp-*``
is a save in progress (or torn by a crash); ``.trash-*`` is a step being deleted. Only committed
steps are ever read.

A leftover is removed only where it carries crashsafe's marker, which every version has written:
its name (``.tmp-step_<n>-<pid>-<hex>``, ``.tmp-step_<n>-<hex>`` for a distributed attempt,
``.trash-step_<n>-<hex>``, with a step's canonical name) and its contents, a real directory holding
nothing but regular files named as crashsafe names a step's files (:func:`is_step_file`). Object
stores have no folders: there, a leftover is an object named as a step's file under ``step_<n>/``.
Anything else (``.tmp-notes/``, a link, a directory holding a file of
someone else's) is not crashsafe's: it is never listed as a leftover, so never removed.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from crashsafe.errors import CorruptCheckpointError
from crashsafe.format.manifest import MAX_STEP
from crashsafe.storage.localdir import LocalDir

__all__ = [
    "LOCK_NAME",
    "TMP_PREFIX",
    "TRASH_PREFIX",
    "committed_steps",
    "is_own",
    "is_step_file",
    "leftovers",
    "parse_step_name",
    "step_dir",
    "step_name",
]

LOCK_NAME = ".lock"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
_STEP = re.compile(r"^step_(\d{12,19})$")
_TMP = re.compile(r"^\.tmp-(step_\d{12,19})-(?:\d+-)?[0-9a-f]+$")
_TRASH = re.compile(r"^\.trash-(step_\d{12,19})-[0-9a-f]+$")
_STEP_FILE = re.compile(r"^(?:manifest\.json|data(?:-[A-Za-z0-9-]+)?\.bin)$")


def step_name(step: int) -> str:
    """``step_000000000042``; steps above 10**12 simply have more digits."""
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be in [0, 2**63 - 1], got {step}")
    return f"step_{step:012d}"


def step_dir(root: Path, step: int) -> Path:
    """The path of a step's directory (for people and tests; crashsafe opens it via LocalDir)."""
    return root / step_name(step)


def parse_step_name(name: str) -> int | None:
    """The step a directory entry names, or None. Only the canonical name of a step counts, so no
    two entries can claim one step."""
    m = _STEP.match(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step <= MAX_STEP and step_name(step) == name else None


def committed_steps(root: LocalDir | str | os.PathLike[str]) -> list[int]:
    """Committed steps under ``root`` (an open directory, or a path: empty if it does not exist)."""
    if isinstance(root, LocalDir):
        names = root.names()
    else:
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            return []
    return sorted(s for name in names if (s := parse_step_name(name)) is not None)


def is_step_file(name: str) -> bool:
    """Whether ``name`` is a file name crashsafe gives a step's files: ``manifest.json``, ``data.bin``,
    ``data-<part>.bin`` (a rank's part), ``data-<attempt>-[<part>-]<k>.bin`` (an object-store shard)."""
    return _STEP_FILE.match(name) is not None


def leftovers(root: LocalDir) -> list[str]:
    """Names of torn saves and half-deleted steps that crashsafe made, which a writer may remove."""
    return sorted(n for n in root.names() if n.startswith((TMP_PREFIX, TRASH_PREFIX)) and is_own(root, n))


def is_own(root: LocalDir, name: str) -> bool:
    """Whether ``name`` carries crashsafe's marker (the module's docstring): its name, and a directory
    (not a link) of regular files named as a step's files, nothing else."""
    match = _TMP.match(name) or _TRASH.match(name)
    if match is None or parse_step_name(match.group(1)) is None:
        return False
    try:
        with root.subdir(name) as folder:
            for child in folder.names():
                mode = os.stat(child, dir_fd=folder.fd, follow_symlinks=False).st_mode
                if not is_step_file(child) or not stat.S_ISREG(mode):
                    return False
    except (OSError, CorruptCheckpointError):  # a link, a file, gone meanwhile: not a leftover to remove
        return False
    return True
