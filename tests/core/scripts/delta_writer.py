"""Save steps with a delta codec and keep_last=2 as fast as possible, until killed.

Usage: delta_writer.py DIR [mixed]. Prints "ready" once the first steps are committed. Every array
of step n holds n, so a reader can check that what it loaded is one consistent step. With ``mixed``
only the ``w*`` arrays are delta-coded and ``b`` is raw, so a restore reads ``b`` before it opens
the steps the deltas run through.
"""

import sys

import numpy as np

import crashsafe as cs

directory = sys.argv[1]
delta = cs.codecs.Incremental(full_every=3)
codec = {"w*": delta, "*": "raw"} if sys.argv[2:] == ["mixed"] else delta
with cs.CheckpointManager(directory, keep_last=2, async_save=False, codec=codec) as mgr:
    for step in range(1_000_000):
        arrays = {f"w{i}": np.full(1024, float(step)) for i in range(16)}
        mgr.save(step, {**arrays, "b": np.full(64, step), "step": step})
        if step == 3:
            print("ready", flush=True)
