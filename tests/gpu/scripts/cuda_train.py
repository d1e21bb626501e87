"""A CUDA training job for the SIGKILL resume test: an MLP with dropout, AdamW, StepLR and the RNG
state, saved asynchronously every few steps, resumed from its newest checkpoint when restarted.

``python cuda_train.py DIR --steps 300 --every 10`` prints ``start <resumed step>`` and ``saved <n>``
lines, and writes the final state's sha256 to DIR/final.txt.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import crashsafe as cs


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 of the weights and the optimizer state, bit for bit."""
    h = hashlib.sha256()
    tensors = [*model.state_dict().values()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    for tensor in tensors:
        h.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", type=Path)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    device = "cuda"
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Dropout(0.1), nn.Linear(1024, 10)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 25, 0.9)
    state = {"model": model, "optim": optimizer, "sched": schedule, "rng": cs.RNGState(), "step": 0}
    with cs.CheckpointManager(args.directory / "ckpt", keep_last=2) as mgr:
        print("start", mgr.restore(state), flush=True)
        while state["step"] < args.steps:
            data = torch.Generator().manual_seed(int(state["step"]))  # the batch is a function of the step
            x = torch.randn(64, 256, generator=data).to(device)
            y = torch.randint(0, 10, (64,), generator=data).to(device)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            state["step"] += 1
            if state["step"] % args.every == 0:
                mgr.save(state["step"], state)
                print("saved", state["step"], flush=True)
    (args.directory / "final.txt").write_text(digest(model, optimizer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
