"""Saves with a validation metric under metric-driven retention (the best 2 and the newest, delta
chains), printing each step once it is committed and retained, until done or killed."""

import sys

import numpy as np

import crashsafe as cs
from crashsafe.policies import KeepBest, KeepLast

directory, steps = sys.argv[1], int(sys.argv[2])
keep = KeepLast(1) | KeepBest(2, "val_loss")
codec = {"w": cs.codecs.Incremental(full_every=4)}
with cs.CheckpointManager(directory, keep=keep, async_save=False, codec=codec) as mgr:
    for step in range(steps):
        val_loss = 1.0 / (1 + step) + (step * 7919 % 13) / 40  # falls, with noise: the best move around
        mgr.save(step, {"w": np.full(64, float(step)), "step": step}, {"val_loss": val_loss})
        print(step, flush=True)
