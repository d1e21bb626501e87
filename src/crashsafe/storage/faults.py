"""Named points of the commit protocol where tests kill the process for real.

Set ``CRASHSAFE_KILL_AT=<point>`` in a child process's environment and it SIGKILLs itself when it
reaches that point. Unset (always, outside tests) this costs one string comparison.
"""

from __future__ import annotations

import os
import signal

__all__ = ["COMMIT_POINTS", "reached"]

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

_KILL_AT = os.environ.get("CRASHSAFE_KILL_AT")


def reached(point: str) -> None:
    """Mark that the protocol reached ``point``; die here if a test asked for it."""
    if point == _KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)
