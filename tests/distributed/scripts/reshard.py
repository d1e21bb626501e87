"""Restore the newest step of IN into a job of this world size and save it again into OUT.

Usage: reshard.py IN OUT NPZ. With WORLD_SIZE > 1 in the environment the job is FSDP2 on that many
ranks (gloo); otherwise one plain process without torch.distributed. Rank 0 writes the whole model
and optimizer state it restored to NPZ, so a test can check every layout ends bit-identical. Each
rank prints one JSON line: the bytes of IN's files its restore read ("read", counted as the store
layer served them: bench/readcount.py) and the bytes of the tensors it holds ("held": its local shards).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from bench.readcount import count_reads
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
        model, optim = build("plain", 1)
    state = {"model": model, "optim": optim, "rng": RNGState(), "step": 0}
    reads = count_reads()
    with CheckpointManager(source, read_only=True) as reader:
        reader.restore(state)
    print(json.dumps({"read": reads.take(), "held": held(model, optim)}), flush=True)
    with CheckpointManager(target) as writer:
        writer.save(state["step"], state)
    save_full(model, optim, out)
    if world > 1:
        leave()


def held(model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    """Bytes of the parameters and optimizer moments this rank holds (a DTensor: its local part)."""
    tensors = [*model.parameters()]
    tensors += [t for slots in optim.state.values() for t in slots.values() if t.dim()]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


if __name__ == "__main__":
    main()
