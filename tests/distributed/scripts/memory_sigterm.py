"""One rank of a 2-rank job with a memory tier (nothing persistent until the 100th save) whose ranks
hear SIGTERM at different moments of the same save: rank 0 before ``save(3)``, rank 1 just after
it. Usage: memory_sigterm.py DISK MEMORY TIMEOUT. Each rank prints "exit N" with its SystemExit code."""

import os
import signal
import sys

import numpy as np
import torch.distributed as dist
from leaving import leave

import crashsafe as cs

disk, memory, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
dist.init_process_group("gloo")
rank = dist.get_rank()
tier = cs.MemoryTier(f"{memory}/{'ab'[rank]}", persist_every=100, host="ab"[rank])
mgr = cs.CheckpointManager(disk, memory=tier, save_on_sigterm=True, coordination_timeout=timeout)
code = None
try:
    for step in (1, 2):
        mgr.save(step, {"x": np.full(100, float(step + rank)), "step": step})
    if rank == 0:
        os.kill(os.getpid(), signal.SIGTERM)  # heard before save(3) decides whether it persists
    mgr.save(3, {"x": np.full(100, 3.0 + rank), "step": 3})
    os.kill(os.getpid(), signal.SIGTERM)  # rank 1: heard once save(3) has decided
    mgr.maybe_save(3, {"x": np.full(100, 3.0 + rank), "step": 3})
except SystemExit as exc:
    code = exc.code
print(f"exit {code}", flush=True)
leave()
