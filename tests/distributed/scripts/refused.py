"""Restores that every rank must refuse before any rank changes its live state.

Usage: refused.py DIR. Saves a model at step 1, trains on (weights 5.0), then restores with a live
state that rank 1 alone cannot take (a key the checkpoint lacks), and asks for a step that was
never committed. Each rank prints one JSON line: the errors' classes and messages, and its weight
after each.
"""

import json
import sys

import torch
import torch.distributed as dist
from leaving import leave

import crashsafe as cs


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(1.0)
    report: dict[str, object] = {}
    with cs.CheckpointManager(sys.argv[1], keep_last=None, coordination_timeout=20) as mgr:
        mgr.save(1, {"model": model, "step": 1})
        mgr.wait()
        with torch.no_grad():
            model.weight.fill_(5.0)  # trained on since
        live: dict[str, object] = {"model": model, "step": 0}
        if rank == 1:
            live["sampler_epoch"] = 3  # rank 1 passes a key the checkpoint lacks
        try:
            mgr.restore(live)
        except cs.CrashsafeError as exc:
            report["mismatch"] = [type(exc).__name__, str(exc)]
        report["weight"] = model.weight[0, 0].item()
        try:
            mgr.restore({"model": model, "step": 0}, step=7)
        except cs.CrashsafeError as exc:
            report["missing"] = type(exc).__name__
    print(json.dumps(report), flush=True)
    leave()


if __name__ == "__main__":
    main()
