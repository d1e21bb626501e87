"""Save steps 1 to 4 in a memory tier (nothing persistent), then restore step 2 and die by SIGKILL
at a named point (``POINT:n``: its n-th arrival there) while the restore deletes the newer memory
steps (newest first; the first is kept out of view as the store's spare), as a restart that goes
back to an older step does."""

import sys

import numpy as np

import crashsafe as cs
import crashsafe._faults as faults

disk, memory, point = sys.argv[1], sys.argv[2], sys.argv[3]
name, _, nth = point.partition(":")
tier = cs.MemoryTier(memory, persist_every=100, keep_last=4)
with cs.CheckpointManager(disk, memory=tier) as mgr:
    for step in (1, 2, 3, 4):
        mgr.save(step, {"x": np.full(1000, float(step)), "step": step})
    mgr.wait()
with cs.CheckpointManager(disk, memory=tier) as mgr:
    faults.arm(name, int(nth or 1))
    mgr.restore({"x": np.zeros(1000), "step": 0}, step=2)
print("survived", flush=True)
