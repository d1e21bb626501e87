"""One rank of a 2-rank job with a memory tier on hosts a and b, whose rank 1 cannot commit its part
of step 3 (as with its RAM disk full). Usage: memory_save_fails.py DISK MEMORY TIMEOUT. Each rank
prints what waiting for save(3) raised, and the seconds it took."""

import sys
import time
from pathlib import Path

import numpy as np
import torch.distributed as dist
from leaving import leave

import crashsafe as cs
import crashsafe.memory_tier as memory_tier

disk, memory, timeout = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 1:
    commit = memory_tier.save_step

    def full(*args, **kwargs):  # type: ignore[no-untyped-def]
        if args[3] == 3:  # (the step)
            raise cs.StorageError(28, "writing step 3: No space left on device")
        return commit(*args, **kwargs)

    memory_tier.save_step = full
tier = cs.MemoryTier(memory / "ab"[rank], host="ab"[rank], persist_every=100)
with cs.CheckpointManager(disk, memory=tier, coordination_timeout=timeout) as mgr:
    for step in (1, 2, 3):
        began = time.monotonic()
        mgr.save(step, {"x": np.full(10, float(step)), "step": step})
    try:
        mgr.wait()
        print("saved", flush=True)
    except cs.CrashsafeError as exc:
        print(f"{type(exc).__name__} {time.monotonic() - began:.0f} s: {exc}".replace("\n", " "), flush=True)
leave()
