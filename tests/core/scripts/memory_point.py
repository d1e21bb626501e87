"""Save steps 1 to 3 in a memory tier (nothing persistent; keeping 2, so step 1 is the spare that
step 4 is written over: five times its size, so a step 4 not cut to size would show), then die by
SIGKILL at a named point of the commit protocol while saving step 4 (``POINT:n``: its n-th arrival
there)."""

import sys

import numpy as np

import crashsafe as cs
import crashsafe._faults as faults

disk, memory, point = sys.argv[1], sys.argv[2], sys.argv[3]
name, _, nth = point.partition(":")
tier = cs.MemoryTier(memory, persist_every=100, keep_last=2)
with cs.CheckpointManager(disk, memory=tier) as mgr:
    for step in (1, 2, 3):
        mgr.save(step, {"x": np.full(5000 if step == 1 else 1000, float(step)), "step": step})
    mgr.wait()
    faults.arm(name, int(nth or 1))
    mgr.save(4, {"x": np.full(1000, 4.0), "step": 4})
    mgr.wait()
print("survived", flush=True)
