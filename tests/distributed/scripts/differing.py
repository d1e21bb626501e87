"""Save a tensor each rank holds under one name with its own values, and ones every rank holds alike.

Usage: differing.py DIR. Four saves: the second adds a tensor (the ranks plan anew), rank 1 then
forgets what the ranks held (as after a failed plan), the fourth is a steady save; then a save of
a step already committed, refused on every rank (JSON: refused). Each rank prints the first value of
each tensor it restored (JSON), then of each it loaded with mmap=True.
"""

import json
import sys

import torch
import torch.distributed as dist
from leaving import leave

from crashsafe.errors import CheckpointExistsError
from crashsafe.manager import CheckpointManager


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mine, ones = torch.full((1024,), float(rank + 1)), torch.ones(1024)
    with CheckpointManager(sys.argv[1], keep_last=None) as mgr:
        mgr.save(1, {"mine": mine, "same": ones})
        mgr.save(2, {"mine": mine * 2, "same": ones, "extra": ones * 7})
        if rank == 1:
            mgr._collective.replicas._described = None  # type: ignore[union-attr]
        mgr.save(3, {"mine": mine * 3, "same": ones, "extra": ones * 7})
        mgr.save(4, {"mine": mine * 4, "same": ones * 4, "extra": ones * 7})
        assert mgr.steps() == [1, 2, 3, 4]  # right after an async save: waits for it, on every rank
        mgr.save(2, {"mine": mine, "same": ones, "extra": ones})  # committed and intact: refused
        try:
            mgr.wait()
        except CheckpointExistsError as exc:
            print(json.dumps({"refused": "already committed" in str(exc)}), flush=True)
        back = {"mine": torch.zeros(1024), "same": torch.zeros(1024), "extra": torch.zeros(1024)}
        mgr.restore(back)
        mapped = mgr.load(mmap=True)  # each rank's own part, as views of the mapped files
    print(json.dumps({k: v[0].item() for k, v in back.items()}), flush=True)
    print(json.dumps({k: float(v[0]) for k, v in mapped.items()}), flush=True)
    leave()


if __name__ == "__main__":
    main()
