"""Peak extra memory of async saves of a large state, as measured by ru_maxrss."""

import resource
import sys

import numpy as np

import crashsafe as cs

directory, mib = sys.argv[1], int(sys.argv[2])
weights = np.empty(mib << 17, dtype=np.float64)
np.random.default_rng(0).standard_normal(out=weights)  # in place: no temporary copy in the baseline
state = {"w": weights}
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with cs.CheckpointManager(directory, keep_last=2) as mgr:
    for step in range(4):
        state["w"][0] = step
        mgr.save(step, state)
    mgr.wait()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"{(peak - base) * 1024} {state['w'].nbytes}", flush=True)
