"""What the 2-rank memory tier scripts share (memory_swapped.py, memory_forged_part.py): save steps 1
to 3 (x = 10 * step + rank), or restore and print "restored STEP X0" or the error restore raised."""

from __future__ import annotations

import numpy as np
import torch.distributed as dist

import crashsafe as cs


def save_or_restore(disk: str, tier: cs.MemoryTier, mode: str) -> None:
    """MODE "save" saves steps 1 to 3 with ``tier``; any other restores and says how it went."""
    rank = dist.get_rank()
    with cs.CheckpointManager(disk, memory=tier, coordination_timeout=30) as mgr:
        if mode == "save":
            for step in (1, 2, 3):
                mgr.save(step, {"x": np.full(100, 10.0 * step + rank), "step": step})
            return
        state = {"x": np.zeros(100), "step": 0}
        try:
            print(f"restored {mgr.restore(state)} {state['x'][0]}", flush=True)
        except cs.CrashsafeError as exc:
            print(f"{type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
