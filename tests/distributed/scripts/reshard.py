"""Restore the newest step of IN into a job of this world size and save it again into OUT.

Usage: reshard.py IN OUT NPZ. With WORLD_SIZE > 1 in the environment the job is FSDP2 on that many
ranks (gloo); otherwise one plain process without torch.distributed. Rank 0 writes the whole model
and optimizer state it restored to NPZ, so a test can check every layout ends bit-identical.
"""

import os
import sys

import torch
import torch.distributed as dist
from job import build, save_full
from leaving import leave

from crashsafe.manager import CheckpointManager
from crashsafe.state.rng import RNGState


def main() -> None:
    source, target, out = sys.argv[1], sys.argv[2], sys.argv[3]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
        model, optim = build("fsdp", world)
    else:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 6))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": optim, "rng": RNGState(), "step": 0}
    with CheckpointManager(source, read_only=True) as reader:
        reader.restore(state)
    with CheckpointManager(target) as writer:
        writer.save(state["step"], state)
    save_full(model, optim, out)
    if world > 1:
        leave()


if __name__ == "__main__":
    main()
