"""Crash-safe DDP or FSDP2 training with torchrun: kill it at any moment, run it again, it resumes.

    torchrun --nproc-per-node=2 --master-addr=127.0.0.1 --master-port=29511 \\
        examples/distributed_train.py --kind fsdp --dir /tmp/crashsafe-dist --steps 300

Every rank builds the same model (an MLP on scikit-learn's bundled digits), wraps it in DDP or
FSDP2 (``fully_shard``), and hands the whole training state to one ``CheckpointManager``: it is
collective because torch.distributed is initialized. Saves are asynchronous (the loop waits only
for a copy into staging memory); a step is committed for every rank or for none. Kill any rank
(``kill -9``) or all of them, and start the same command again: it restores the newest step that
every rank reads intact and goes on from there, bit-identically to a run that was never killed.
Change ``--nproc-per-node`` between runs and the checkpoint is resharded on load.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits

import crashsafe as cs


def build(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )  # fmt: skip
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["ddp", "fsdp"], default="fsdp")
    parser.add_argument("--dir", default="/tmp/crashsafe-dist", help="checkpoint directory or URL")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=20, help="save every N steps")
    parser.add_argument("--pause", type=float, default=0.01, help="seconds per step (time to kill it)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x_all, y_all = load_digits(return_X_y=True)
    x_all = torch.tensor(x_all / 16.0, dtype=torch.float32)
    y_all = torch.tensor(y_all)
    model, optim = build(args.kind)
    state: dict[str, Any] = {"model": model, "optim": optim, "rng": cs.RNGState(), "step": 0}

    with cs.CheckpointManager(args.dir, keep_last=3) as mgr:
        mgr.restore(state)  # collective: every rank restores the same step, or all start fresh
        if rank == 0:
            print(f"{world} ranks, {args.kind}: starting at step {state['step']}", flush=True)
        started = time.perf_counter()
        while state["step"] < args.steps:
            step = state["step"]
            batch = torch.Generator().manual_seed(step * world + rank)  # each rank its own data
            pick = torch.randint(0, len(x_all), (64,), generator=batch)
            loss = torch.nn.functional.cross_entropy(model(x_all[pick]), y_all[pick])
            optim.zero_grad()
            loss.backward()
            optim.step()
            state["step"] = step + 1
            if state["step"] % args.every == 0:
                mgr.save(state["step"], state, metrics={"loss": loss.item()})
                if rank == 0:
                    print(f"step {state['step']:>5}  loss {loss.item():.4f}  saved", flush=True)
            time.sleep(args.pause)
        mgr.wait()
        steps = mgr.steps()  # collective, like every manager call: every rank makes it
        if rank == 0:
            took = time.perf_counter() - started
            print(
                f"done: step {state['step']} in {took:.1f} s; checkpoints {steps} in {args.dir}", flush=True
            )
    with torch.no_grad():
        accuracy = (model(x_all).argmax(1) == y_all).float().mean()
    if rank == 0:
        print(f"training accuracy {float(accuracy):.3f}", flush=True)
    dist.barrier()  # leave together: gloo can abort a rank whose peer tears down its pairs first
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
