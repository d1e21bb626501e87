"""Commit step 1, then die by SIGKILL at a named point of the protocol while saving step 2."""

import sys

import numpy as np

import crashsafe as cs
import crashsafe._faults as faults

directory, point, mode = sys.argv[1], sys.argv[2], sys.argv[3]
with cs.CheckpointManager(directory, keep_last=1, async_save=(mode == "async")) as mgr:
    mgr.save(1, {"x": np.full(1000, 1.0), "y": np.arange(10), "step": 1})
    mgr.wait()
    faults.arm(point)
    mgr.save(2, {"x": np.full(1000, 2.0), "y": np.arange(10) * 2, "step": 2})
    mgr.wait()
print("survived", flush=True)
