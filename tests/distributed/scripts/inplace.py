"""Restore an FSDP2 checkpoint into a job whose model and optimizer already hold every tensor.

Usage: inplace.py DIR NPZ [STEP]. Each rank prints one JSON line: the step restored, the bytes read
straight into live memory (StepReader.read_into, counted here), and whether every live tensor
kept its memory. Rank 0 writes the whole model and optimizer state to NPZ.
"""

import json
import sys

import numpy as np
import torch
import torch.distributed as dist
from job import build, save_full
from leaving import leave

from crashsafe.manager import CheckpointManager
from crashsafe.state.rng import RNGState
from crashsafe.storage.reader import StepReader


def main() -> None:
    directory, out = sys.argv[1], sys.argv[2]
    step = int(sys.argv[3]) if len(sys.argv) > 3 else None
    dist.init_process_group("gloo")
    model, optim = build("fsdp", dist.get_world_size())
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optim.step()  # the optimizer's moments exist now: every saved tensor has a live one
    state = {"model": model, "optim": optim, "rng": RNGState(), "step": 0}
    live = [p.to_local() for p in model.parameters()]
    live += [t.to_local() for slots in optim.state.values() for t in slots.values() if t.dim()]
    memory = [t.data_ptr() for t in live]
    read = []
    read_into = StepReader.read_into

    def counted(self: StepReader, entry: object, out: np.ndarray) -> None:
        read.append(out.nbytes)
        read_into(self, entry, out)  # type: ignore[arg-type]

    StepReader.read_into = counted  # type: ignore[method-assign]
    with CheckpointManager(directory, read_only=True) as reader:
        reader.restore(state, step=step)
    kept = memory == [t.data_ptr() for t in live]
    print(json.dumps({"step": state["step"], "read_into": sum(read), "kept_memory": kept}), flush=True)
    save_full(model, optim, out)
    leave()


if __name__ == "__main__":
    main()
