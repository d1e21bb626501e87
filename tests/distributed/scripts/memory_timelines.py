"""One rank of a 3-rank job with a memory tier (2 copies of each part, keeping 2 steps, every 2nd
save persistent). Usage: memory_timelines.py DISK MEMORY HOSTS RUN SAVES [STEP]: HOSTS names each
rank's host (a comma list), so a restart may place ranks on other hosts; the rank restores (STEP,
else the newest), prints "restored STEP RUN" (the run that saved what it restored), then saves the
next SAVES steps as run RUN."""

import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist
from leaving import leave

import crashsafe as cs

disk, memory, hosts, run = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(","), int(sys.argv[4])
saves, asked = int(sys.argv[5]), int(sys.argv[6]) if len(sys.argv) > 6 else None
dist.init_process_group("gloo")
rank = dist.get_rank()
host = hosts[rank]
tier = cs.MemoryTier(memory / host, persist_every=2, keep_last=2, host=host)
with cs.CheckpointManager(disk, memory=tier, coordination_timeout=30) as mgr:
    state = {"run": np.zeros(1), "step": 0}
    mgr.restore(state, step=asked)
    print(f"restored {state['step']} {int(state['run'][0])}", flush=True)
    for step in range(state["step"] + 1, state["step"] + 1 + saves):
        mgr.save(step, {"run": np.full(1, float(run)), "step": step})
leave()
