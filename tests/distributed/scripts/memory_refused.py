"""One rank of a 2-rank job with a memory tier on hosts a and b, whose rank 1 finds its part's
store ``b/rank_1`` a link (the test made it): refused there. Usage: memory_refused.py DISK MEMORY
TIMEOUT. Each rank prints the error opening its manager raised, and the seconds it took."""

import sys
import time
from pathlib import Path

import torch.distributed as dist
from leaving import leave

import crashsafe as cs

disk, memory, timeout = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
dist.init_process_group("gloo")
rank = dist.get_rank()
tier = cs.MemoryTier(memory / "ab"[rank], host="ab"[rank])
began = time.monotonic()
try:
    cs.CheckpointManager(disk, memory=tier, coordination_timeout=timeout).close()
    print("opened", flush=True)
except cs.CrashsafeError as exc:
    print(f"{type(exc).__name__} {time.monotonic() - began:.0f} s: {exc}".replace("\n", " "), flush=True)
leave()
