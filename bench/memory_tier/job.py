"""One rank of the training job the memory tier benchmark kills (bench/memory_tier/kills.py).

``python -m bench.memory_tier.job CONFIG.json``: restores the newest step (memory tier, else the
persistent one), prints ``resumed N SOURCE SECONDS``, then trains, saving every step to the memory
tier (``mode`` "memory", every ``persist_every``th also persistent) or every ``persist_every``
steps to the persistent tier only (``mode`` "persistent", as without a memory tier), and prints
``step N`` once step N is trained and its save has returned (``sync``: saves block until
committed, memory copies included); until ``stop`` or a SIGKILL.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import crashsafe as cs
from bench.distributed.group import join, leave
from bench.distributed.model import build
from bench.memory_tier.training import host_of, train_step


def main(config: str) -> None:
    cfg = json.loads(Path(config).read_text())
    warnings.simplefilter("ignore")  # FSDP's advice
    torch.set_num_threads(1)
    store = join()
    rank, world = dist.get_rank(), dist.get_world_size()
    host, every = host_of(rank, world), cfg["persist_every"]
    model, optim = build(cfg["kind"], cfg["total"], world, trained=True)
    state: dict[str, Any] = {"model": model, "optim": optim, "step": 0}
    tier = None
    if cfg["mode"] == "memory":
        tier = cs.MemoryTier(Path(cfg["shm"]) / host, persist_every=every, host=host)
    began = time.perf_counter()
    with cs.CheckpointManager(cfg["disk"], keep_last=2, memory=tier, async_save=not cfg["sync"]) as mgr:
        found = mgr.restore(state)
        source = mgr.recovery.source if mgr.recovery else ("none" if found is None else "persistent")
        print(
            f"resumed {state['step']} {source.replace(' ', '_')} {time.perf_counter() - began:.3f}",
            flush=True,
        )
        while state["step"] < cfg["stop"]:
            step = state["step"] + 1
            train_step(model, optim, 1000 * step + rank, cfg["batch"])
            state["step"] = step
            if tier is not None or step % every == 0:
                mgr.save(step, state)
            print(f"step {step}", flush=True)
    leave(store)


if __name__ == "__main__":
    main(sys.argv[1])
