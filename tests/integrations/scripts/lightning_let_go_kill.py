"""CrashsafeCheckpointIO SIGKILLed where it lets steps go. ``removal``: Lightning removed two
checkpoints while the writer was busy, their pointers became removal marks and the deletion of
the first step (the newest) was under way. ``first``: a directory's first save committed, its
pointer not written yet.

Run by tests/integrations/test_lightning_crash.py in a forked process with ``ARGS = [directory, mode]``.
"""

from __future__ import annotations

from pathlib import Path

import torch

import crashsafe._faults as faults
from crashsafe.integrations.lightning import CrashsafeCheckpointIO


def main(directory: Path, mode: str) -> None:
    io = CrashsafeCheckpointIO()
    if mode == "first":
        faults.arm("after_fsync_root")
        io.save_checkpoint({"global_step": 1, "w": torch.ones(4)}, directory / "a.ckpt")
        return
    io.save_checkpoint({"global_step": 1, "w": torch.ones(4)}, directory / "a.ckpt")
    io.save_checkpoint({"global_step": 2, "w": torch.ones(4)}, directory / "b.ckpt")
    io.wait()
    faults.arm("after_trash_rename")
    big = {"global_step": 3, "w": torch.ones(16_000_000)}  # 64 MB: committed while both removals queue
    io.save_checkpoint(big, directory / "c.ckpt")
    io.remove_checkpoint(directory / "a.ckpt")
    io.remove_checkpoint(directory / "b.ckpt")
    io.wait()


if __name__ == "__main__":
    main(*globals()["ARGS"])  # given by the test (runpy.run_path)
