"""Save a tensor each rank holds under one name with its own values, and one every rank holds alike.

Usage: differing.py DIR. Each rank prints the first value of each tensor it restored (JSON).
"""

import json
import sys

import torch
import torch.distributed as dist
from leaving import leave

from crashsafe.manager import CheckpointManager


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with CheckpointManager(sys.argv[1]) as mgr:
        mgr.save(1, {"mine": torch.full((1024,), float(rank + 1)), "same": torch.ones(1024)})
        back = {"mine": torch.zeros(1024), "same": torch.zeros(1024)}
        mgr.restore(back)
    print(json.dumps({k: v[0].item() for k, v in back.items()}), flush=True)
    leave()


if __name__ == "__main__":
    main()
