"""Save steps 1 and 2 in a memory tier (nothing persistent), then die by SIGKILL at a named point of
the commit protocol while saving step 3 (``POINT:n``: its n-th arrival there)."""

import sys

import numpy as np

import crashsafe as cs
import crashsafe._faults as faults

disk, memory, point = sys.argv[1], sys.argv[2], sys.argv[3]
name, _, nth = point.partition(":")
tier = cs.MemoryTier(memory, persist_every=100, keep_last=2)
with cs.CheckpointManager(disk, memory=tier) as mgr:
    for step in (1, 2):
        mgr.save(step, {"x": np.full(1000, float(step)), "step": step})
    mgr.wait()
    faults.arm(name, int(nth or 1))
    mgr.save(3, {"x": np.full(1000, 3.0), "step": 3})
    mgr.wait()
print("survived", flush=True)
