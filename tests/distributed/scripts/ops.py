"""Collective steps, delete and gc of an FSDP2 job, on any location (a directory or a URL).

Usage: ops.py LOCATION STORAGE_OPTIONS_JSON. Saves steps 1..4 with a delta codec (a full save
every second step), verifies them, is refused deleting the base step 1, deletes step 2, reopens
with keep_last=1 and collects garbage, then restores into a fresh model. Each rank prints one
JSON line; a test checks that every rank saw the same and that the restored model is the one saved.
"""

import json
import sys

import torch
import torch.distributed as dist
from job import build, full
from leaving import leave

import crashsafe as cs


def main() -> None:
    location, options = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    model, optim = build("fsdp", world)
    state = {"model": model, "optim": optim, "step": 0}
    report: dict[str, object] = {}
    codec = cs.codecs.Incremental(full_every=2)
    with cs.CheckpointManager(
        location, keep_last=None, storage_options=options, codec=codec, async_save=False
    ) as mgr:
        for step in range(1, 5):
            model(torch.ones(4, 8)).sum().backward()
            optim.step()
            state["step"] = step
            mgr.save(step, state)
        report["saved"] = mgr.steps()
        report["intact"] = cs.verify(location, storage_options=options).intact  # the ranks' deltas apart
        try:
            mgr.delete([1])  # step 2 is a delta of it: refused on every rank
        except cs.CrashsafeError as exc:
            report["refused"] = str(exc).split(":")[0]
        mgr.delete([2])
        report["after_delete"] = mgr.steps()
    with cs.CheckpointManager(location, keep_last=1, storage_options=options) as mgr:
        report["gc"] = mgr.gc()
        report["after_gc"] = mgr.steps()
        fresh, fresh_optim = build("fsdp", world)
        again = {"model": fresh, "optim": fresh_optim, "step": 0}
        mgr.restore(again)
        report["restored"] = again["step"]
        pairs = zip(model.parameters(), fresh.parameters(), strict=True)
        report["same"] = all(bool((full(a) == full(b)).all()) for a, b in pairs)
    print(json.dumps(report), flush=True)
    leave()


if __name__ == "__main__":
    main()
