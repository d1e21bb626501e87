"""One rank of a 2-rank job with a memory tier on hosts a and b. Usage: memory_swapped.py DISK MEMORY
MODE. MODE "save": saves steps 1 to 3 (x = 10 * step + rank). MODE "restore": restores, and rank 0's
own copy of step 3 is damaged after the ranks listed it and before they restore it (its manifest
flipped). Each rank prints "restored STEP X0" or the error restore raised."""

import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist
from leaving import leave

import crashsafe as cs
import crashsafe.recovery as recovery

disk, memory, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
rank = dist.get_rank()
tier = cs.MemoryTier(memory / "ab"[rank], persist_every=100, host="ab"[rank])
if mode == "restore" and rank == 0:
    pull, damaged = recovery._pull, []

    def damaging(memory, step, *rest):  # type: ignore[no-untyped-def]
        source = pull(memory, step, *rest)
        manifest = Path(memory.own.location) / f"step_{step:012d}" / "manifest.json"
        if step == 3 and not damaged:  # (once: the copy pulled in its place stays intact)
            damaged.append(step)
            raw = bytearray(manifest.read_bytes())
            raw[len(raw) // 2] ^= 0x01
            manifest.write_bytes(bytes(raw))
        return source

    recovery._pull = damaging
with cs.CheckpointManager(disk, memory=tier, coordination_timeout=30) as mgr:
    if mode == "save":
        for step in (1, 2, 3):
            mgr.save(step, {"x": np.full(100, 10.0 * step + rank), "step": step})
    else:
        state = {"x": np.zeros(100), "step": 0}
        try:
            print(f"restored {mgr.restore(state)} {state['x'][0]}", flush=True)
        except cs.CrashsafeError as exc:
            print(f"{type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
leave()
