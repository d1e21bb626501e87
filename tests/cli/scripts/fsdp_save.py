"""One rank of a 2-rank FSDP2 job (gloo on 127.0.0.1) that saves steps 1..3 with crashsafe and, on
rank 0, writes the full model state of step 3 to OUT (.npz): a real distributed checkpoint for the
command line's tests.

Usage (env RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT set by the test): fsdp_save.py DIR OUT
"""

import sys

import numpy as np
import torch
import torch.distributed as dist
from leaving import leave
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from crashsafe.manager import CheckpointManager


def main() -> None:
    directory, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 6))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(directory, keep_last=None, async_save=False, coordination_timeout=60) as mgr:
        for step in range(1, 4):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * step + rank))
            optim.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            optim.step()
            mgr.save(
                step, {"model": model, "optim": optim, "step": step}, metrics={"loss": float(loss.detach())}
            )
    full = {k: v.full_tensor().detach().numpy() for k, v in model.state_dict().items()}
    if rank == 0:
        np.savez(out, **full)
    leave()


if __name__ == "__main__":
    main()
