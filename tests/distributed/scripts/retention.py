"""Retention that fails on rank 0 after collective commits: every rank still sees each step committed.

Usage: retention.py LOCATION. The test runs rank 0 with CRASHSAFE_FAIL_AT=mid_delete: each of its
deletions meets an I/O error. A DDP job saves steps 1..3 with keep_last=1 (retention after steps 2
and 3 fails), then rank 0 disarms and step 4 is saved (retention deletes what is left). Each rank
prints one JSON line: what it saw, and how many RetentionWarnings it got.
"""

import json
import sys
import warnings

import torch
import torch.distributed as dist
from job import build
from leaving import leave

import crashsafe as cs
import crashsafe._faults as faults


def main() -> None:
    location = sys.argv[1]
    dist.init_process_group("gloo")
    model, optim = build("ddp", dist.get_world_size())
    state = {"model": model, "optim": optim, "step": 0}
    report: dict[str, object] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cs.CheckpointManager(location, keep_last=1) as mgr:
            for step in range(1, 5):
                if step == 4:
                    faults.arm(None, fail=True)
                model(torch.ones(4, 8)).sum().backward()
                optim.step()
                state["step"] = step
                mgr.save(step, state)
                mgr.wait()
                report[f"after_{step}"] = mgr.steps()
    report["warned"] = sum(issubclass(w.category, cs.RetentionWarning) for w in caught)
    print(json.dumps(report), flush=True)
    leave()


if __name__ == "__main__":
    main()
