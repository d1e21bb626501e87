"""One rank of a 2-rank job with a memory tier: saves steps 1 and 2, then restores them into a new
manager, rank 1 into a live state that does not fit (another shape). Usage: memory_mismatch.py DISK
MEMORY TIMEOUT. Each rank prints one line: the error restore raised (its type and message)."""

import sys

import numpy as np
import torch.distributed as dist
from leaving import leave

import crashsafe as cs

disk, memory, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
dist.init_process_group("gloo")
rank = dist.get_rank()
tier = cs.MemoryTier(f"{memory}/{'ab'[rank]}", persist_every=100, host="ab"[rank])
with cs.CheckpointManager(disk, memory=tier, coordination_timeout=timeout) as mgr:
    for step in (1, 2):
        mgr.save(step, {"x": np.full(100, float(step + rank)), "step": step})
with cs.CheckpointManager(disk, memory=tier, coordination_timeout=timeout) as mgr:
    try:
        mgr.restore({"x": np.zeros(100 if rank == 0 else 50), "step": 0})
        print("restored", flush=True)
    except cs.CrashsafeError as exc:
        print(f"{type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
leave()
