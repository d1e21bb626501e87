"""One rank of a 2-rank job with a memory tier on hosts a and b keeping 1 step (nothing persistent).
Usage: memory_retention.py DISK MEMORY MODE. MODE "save": saves steps 1 to 3. "resume": restores,
then saves step 4, whose copy of rank 0's part rank 1 fails to keep (as with its RAM disk full).
"restore": restores. Each rank prints "restored STEP" after a restore."""

import sys
import warnings
from pathlib import Path

import numpy as np
import torch.distributed as dist
from leaving import leave

import crashsafe as cs
import crashsafe.distributed.peers as peers

disk, memory, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
rank = dist.get_rank()
tier = cs.MemoryTier(memory / "ab"[rank], persist_every=100, keep_last=1, host="ab"[rank])
if mode == "resume" and rank == 1:
    keep = peers._commit
    peers._commit = lambda t, *rest: "No space left on device" if t.step == 4 else keep(t, *rest)
warnings.simplefilter("ignore", cs.CrashsafeWarning)  # (fewer copies than asked: said, and expected)
with cs.CheckpointManager(disk, memory=tier, coordination_timeout=30) as mgr:
    state = {"x": np.zeros(100), "step": 0}
    if mode != "save":
        print(f"restored {mgr.restore(state)}", flush=True)
    for step in {"save": (1, 2, 3), "resume": (4,), "restore": ()}[mode]:
        mgr.save(step, {"x": np.full(100, 10.0 * step + rank), "step": step})
leave()
