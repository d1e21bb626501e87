"""Save steps forever (content derived from the step) until the parent SIGKILLs us."""

import sys

import numpy as np

import crashsafe as cs

directory, mode, keep_last = sys.argv[1], sys.argv[2], int(sys.argv[3])
with cs.CheckpointManager(directory, keep_last=keep_last, async_save=(mode == "async")) as mgr:
    step = (mgr.latest_step() or 0) + 1
    print("ready", flush=True)
    while True:
        state = {
            "a": np.full(1 << 20, step, dtype=np.float32),
            "b": {"ints": np.arange(1 << 14, dtype=np.int64) * step, "name": f"step{step}"},
            "step": step,
        }
        mgr.save(step, state)
        step += 1
