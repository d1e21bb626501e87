"""Ranks that would save apart: a time-based policy on ranks whose steps take different times, and
explicit saves of different step numbers.

Usage: apart.py DIR. Rank 0 reaches maybe_save later in each step (as if it logged the loss), so
the ranks' clocks disagree on when 0.3 s have passed. Each rank prints one JSON line: the steps
maybe_save saved, the steps committed, and whether a save of another step number on each rank was
refused.
"""

import json
import sys
import time

import torch
import torch.distributed as dist
from leaving import leave

import crashsafe as cs
from crashsafe.policies import EverySeconds


def main() -> None:
    directory = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = {"w": torch.zeros(1000), "step": 0}
    report: dict[str, object] = {"saved": []}
    policy = EverySeconds(0.3)
    with cs.CheckpointManager(directory, keep_last=None, policy=policy, coordination_timeout=20) as mgr:
        mgr.save(0, state)
        for step in range(1, 16):
            time.sleep(0.05)
            x = torch.ones(1)
            dist.all_reduce(x)  # the training's own collective: the ranks step in lockstep
            time.sleep(0.07 * (rank == 0))  # rank 0 logs the loss: it reaches maybe_save later
            state["w"] += 1
            state["step"] = step
            if mgr.maybe_save(step, state):
                report["saved"].append(step)  # type: ignore[attr-defined]
        mgr.wait()
        report["committed"] = mgr.steps()
        try:
            mgr.save(100 + rank, state)  # each rank another step number
            mgr.wait()
        except cs.CoordinationError as exc:
            report["refused"] = "the ranks saved different steps" in str(exc)
        report["after"] = mgr.steps()
    print(json.dumps(report), flush=True)
    leave()


if __name__ == "__main__":
    main()
