"""Child process for the SIGKILL test: resume from the newest checkpoint, then train an MLP with
Adam and save every step through LC (model) and incremental (optimizer) delta chains."""

from __future__ import annotations

import sys

import torch

import crashsafe as cs


def main(directory: str, total: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": optim, "step": 0}
    codec = {"model.*": cs.codecs.LC(bits=3, full_every=7), "*": cs.codecs.Incremental(full_every=5)}
    with cs.CheckpointManager(directory, keep_last=2, codec=codec) as mgr:
        found = mgr.restore(state)
        start = 0 if found is None else found + 1
        for step in range(start, total):
            x = torch.randn(64, 32, generator=torch.Generator().manual_seed(step))
            loss = model(x).pow(2).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            state["step"] = step
            mgr.save(step, state)
            print(step, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
