"""Train a small model, saving rarely; on SIGTERM the manager commits the current step and exits."""

import sys

import torch
import xxhash

import crashsafe as cs

directory = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Linear(32, 8)
optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
state = {"model": model, "optim": optim, "step": 0}
policy = cs.policies.EverySteps(10_000)
with cs.CheckpointManager(directory, policy=policy, save_on_sigterm=True) as mgr:
    step = 0
    while True:
        step += 1
        optim.zero_grad()
        model(torch.randn(16, 32)).pow(2).mean().backward()
        optim.step()
        state["step"] = step
        digest = xxhash.xxh3_64_hexdigest(model.weight.detach().numpy().tobytes())
        print(f"step {step} {digest}", flush=True)
        mgr.maybe_save(step, state)
