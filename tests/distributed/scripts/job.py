"""One rank of a small DDP or FSDP2 training job that checkpoints with crashsafe.

Usage (env RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT set by the test):
    job.py KIND DIR STEPS EVERY OUT [TIMEOUT] [STOP]
KIND is ddp or fsdp. The job restores from DIR (if a step is there), trains to STEPS saving every
EVERY steps, and rank 0 writes the final full model and optimizer state to OUT (.npz). With STOP it
first trains to STOP only, then builds a fresh model, optimizer and RNG state and resumes from the
checkpoint, as a restarted job would. Batches are drawn from (step, rank), so a resumed run sees the
same data as an uninterrupted one. Prints "resumed N" at start and "step N" after each step.
Environment: JOB_WIDTH, the hidden layer's width (32); JOB_CHUNK_BYTES, the size of the chunks
whose checksums a raw shard's entry lists (crashsafe's own unless given), for this job and the
scripts that build their model here; JOB_FROZEN=1 puts a frozen Linear(WIDTH, 4096) (512 KiB,
big enough that saves refer to it once committed: docs/unchanged.md) between the trained layers.
JOB_MEMORY=ROOT adds a memory tier in ROOT/<host>, the host of each rank named by JOB_HOSTS (a comma
list, one per rank), saving to DIR every JOB_PERSIST_EVERY-th save (5); the job then prints "source
S" and "recovery SECONDS" after "resumed N": where the restore came from, and how long it took.
JOB_DEVICE=cuda trains on the GPU (every rank on the current device; kind ddp or plain, gloo
moving CUDA tensors; tests/gpu/run.sh runs it).
JOB_PERSISTENT_FAULT=1 injects a fault in this job (the field test's, bench/memory_field.py): if DIR
holds a committed step when the job starts, every listing or opening of a step of DIR while the job
restores prints "FAULT ..." on stderr and raises, so a restore that reads the persistent tier fails.
"""

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from leaving import leave

from crashsafe.distributed import saving
from crashsafe.errors import StorageError
from crashsafe.manager import CheckpointManager
from crashsafe.memory_tier import MemoryTier
from crashsafe.state.rng import RNGState
from crashsafe.storage.layout import committed_steps
from crashsafe.storage.local import LocalStore

WIDTH = int(os.environ.get("JOB_WIDTH", "32"))
DEVICE = torch.device(os.environ.get("JOB_DEVICE", "cpu"))
if "JOB_CHUNK_BYTES" in os.environ:
    saving.CHUNK_BYTES = int(os.environ["JOB_CHUNK_BYTES"])


def build(kind: str, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model (``kind`` on ``world`` ranks, or plain for ``kind`` "plain") and its AdamW."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(8, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 6)]
    if os.environ.get("JOB_FROZEN") == "1":
        frozen = torch.nn.Linear(WIDTH, 4096)
        frozen.requires_grad_(False)
        layers[2:] = [frozen, torch.nn.Tanh(), torch.nn.Linear(4096, 6)]
    model = torch.nn.Sequential(*layers).to(DEVICE)
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@contextlib.contextmanager
def persistent_reads_fail(directory: str) -> Iterator[None]:
    """With JOB_PERSISTENT_FAULT=1 and a committed step in ``directory`` (the persistent tier), every
    listing or opening of its steps in the block says so on stderr and raises StorageError: a fault
    injected in this process, at the store the manager reads the persistent tier through."""
    if os.environ.get("JOB_PERSISTENT_FAULT") != "1" or not committed_steps(directory):
        yield
        return
    where = Path(directory).resolve()
    originals = {name: getattr(LocalStore, name) for name in ("steps", "has_step", "open_step")}

    def failing(name: str, original: Any) -> Any:
        def read(self: LocalStore, *args: Any) -> Any:
            if Path(self.location).resolve() != where:  # (a memory store: read as usual)
                return original(self, *args)
            print(
                f"FAULT: the persistent tier was read while restoring: {name}{args}",
                file=sys.stderr,
                flush=True,
            )
            raise StorageError(
                f"the persistent tier {where} fails every read (a fault the field test injects)"
            )

        return read

    for name, original in originals.items():
        setattr(LocalStore, name, failing(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(LocalStore, name, original)


def full(value: torch.Tensor) -> np.ndarray:
    tensor = value.full_tensor() if hasattr(value, "full_tensor") else value
    return tensor.detach().cpu().numpy().copy()


def save_full(model: torch.nn.Module, optim: torch.optim.Optimizer, out: str) -> None:
    """Rank 0 (or a plain process) writes the whole model and optimizer state to ``out`` (.npz);
    every rank calls it (gathering a DTensor whole is collective)."""
    arrays = {f"model.{k}": full(v) for k, v in model.state_dict().items()}
    for i, slots in optim.state_dict()["state"].items():
        arrays.update({f"optim.{i}.{k}": full(v) for k, v in slots.items()})
    if not dist.is_initialized() or dist.get_rank() == 0:
        np.savez(out, **arrays)


def train(kind: str, directory: str, steps: int, every: int, timeout: float) -> tuple[Any, Any]:
    """Restore (if a step is there), then train to ``steps``; return the model and optimizer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim = build(kind, world)
    state = {"model": model, "optim": optim, "rng": RNGState(), "step": 0}
    sync = os.environ.get("JOB_SYNC_SAVES") == "1"  # saves block: the save itself meets a dead rank
    memory = None
    if "JOB_MEMORY" in os.environ:
        host = os.environ["JOB_HOSTS"].split(",")[rank]
        every_nth = int(os.environ.get("JOB_PERSIST_EVERY", "5"))
        memory = MemoryTier(f"{os.environ['JOB_MEMORY']}/{host}", persist_every=every_nth, host=host)
    with CheckpointManager(
        directory, keep_last=2, coordination_timeout=timeout, async_save=not sync, memory=memory
    ) as mgr:
        with persistent_reads_fail(directory):
            mgr.restore(state)
        print(f"resumed {state['step']}", flush=True)
        if memory is not None:
            print(f"source {mgr.recovery.source if mgr.recovery else 'none'}", flush=True)
            print(f"recovery {mgr.recovery.seconds if mgr.recovery else 0:.3f}", flush=True)
        while state["step"] < steps:
            step = state["step"]
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, noise = (
                torch.randn(16, 8, generator=g),
                torch.randn(16, 6) * 0.01,
            )  # rng used: restored exactly
            x, noise = x.to(DEVICE), noise.to(DEVICE)
            optim.zero_grad()
            (model(x) + noise).pow(2).mean().backward()
            optim.step()
            state["step"] = step + 1
            time.sleep(0.02)  # a step takes a while, so a kill can land anywhere in it
            if state["step"] % every == 0:
                time.sleep(float(os.environ.get("JOB_LATE_SAVE", "0")))  # this rank reaches save last
                mgr.save(state["step"], state)
            print(f"step {state['step']}", flush=True)
    return model, optim


def main() -> None:
    kind, directory, steps, every, out = (
        sys.argv[1],
        sys.argv[2],
        int(sys.argv[3]),
        int(sys.argv[4]),
        sys.argv[5],
    )
    timeout = float(sys.argv[6]) if len(sys.argv) > 6 else 60.0
    dist.init_process_group("gloo")
    if len(sys.argv) > 7:
        train(kind, directory, int(sys.argv[7]), every, timeout)
    model, optim = train(kind, directory, steps, every, timeout)
    save_full(model, optim, out)
    leave()


if __name__ == "__main__":
    main()
