"""Named points of crashsafe's commit protocols (checkpoint steps, the shelf) where tests kill the
process for real. Any layer may mark its points here; nothing here imports crashsafe.

A test child process calls :func:`arm` (or sets ``CRASHSAFE_KILL_AT=<point>`` in its environment)
and SIGKILLs itself when it reaches that point (``<point>:<n>``: the n-th time it gets there, to
aim at one deletion among many). ``arm(point, fail=True)`` (or ``CRASHSAFE_FAIL_AT``) raises the
I/O error a failing disk or network would give there instead, every time. Unarmed (always,
outside tests) this costs two string comparisons.
"""

from __future__ import annotations

import errno
import os
import signal

__all__ = [
    "COMMIT_POINTS",
    "OBJECT_COMMIT_POINTS",
    "RECYCLE_POINTS",
    "SHELF_ARMED",
    "arm",
    "reached",
    "write_in_halves",
]

COMMIT_POINTS = (
    "after_mkdir_tmp",
    "mid_data",
    "after_fsync_data",
    "after_write_manifest",
    "after_fsync_tmp_dir",
    "after_rename",
    "after_fsync_root",
    "after_trash_rename",
    "mid_delete",
)
# a local store that recycles (storage/local.py): the spare's data file moved into a draft
RECYCLE_POINTS = ("after_recycle",)
# the manifest-last protocol of object stores (storage/objectstore.py); mid_data and mid_delete too
OBJECT_COMMIT_POINTS = (
    "mid_upload",
    "after_upload_data",
    "after_lease_check",
    "after_put_manifest",
    "after_unlink_manifest",
)

_KILL_AT, _, _NTH = (os.environ.get("CRASHSAFE_KILL_AT") or "").partition(":")
_LEFT = int(_NTH or 1)  # arrivals at _KILL_AT before the one that dies
SHELF_ARMED = _KILL_AT.startswith("shelf_")  # the shelf's hot paths test this, not reached()
_FAIL_AT = os.environ.get("CRASHSAFE_FAIL_AT") or ""


def arm(point: str | None, nth: int = 1, *, fail: bool = False) -> None:
    """Make this process SIGKILL itself the ``nth`` time it reaches ``point`` (None disarms), or
    with ``fail`` raise an OSError each time it does."""
    global _KILL_AT, _LEFT, _FAIL_AT
    known = COMMIT_POINTS + OBJECT_COMMIT_POINTS + RECYCLE_POINTS
    if point is not None and point not in known:
        raise ValueError(f"unknown commit point {point!r}; known: {', '.join(known)}")
    if fail:
        _FAIL_AT = point or ""
    else:
        _KILL_AT, _LEFT = point or "", nth


def reached(point: str) -> None:
    """Mark that the protocol reached ``point``; die (or fail) here if a test asked for it."""
    global _LEFT
    if point == _FAIL_AT:
        raise OSError(errno.EIO, f"I/O error injected at {point}")
    if point == _KILL_AT:
        _LEFT -= 1
        if _LEFT == 0:
            os.kill(os.getpid(), signal.SIGKILL)


def write_in_halves(buf: memoryview, at: int, data: bytes, point: str) -> None:
    """Write ``data`` at ``at`` in two halves with ``point`` reached between them: a torn write,
    when a test kills the process there."""
    half = len(data) // 2
    buf[at : at + half] = data[:half]
    reached(point)
    buf[at + half : at + len(data)] = data[half:]
