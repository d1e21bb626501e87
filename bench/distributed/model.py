"""The benchmark's state: the same MLP + AdamW on every rank, as DDP replicas or FSDP2 shards."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

WIDTH = 2048  # an MLP of WIDTH x WIDTH layers; parameters + AdamW's two moments = the state


def layers_for(total_bytes: int) -> int:
    """Layers whose fp32 parameters and AdamW moments (3 copies) take ``total_bytes``."""
    return max(1, round(total_bytes / (3 * 4 * (WIDTH * WIDTH + WIDTH))))


def build(
    kind: str, total_bytes: int, world: int, trained: bool
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same MLP on every rank: DDP replicas or FSDP2 shards (``fully_shard`` per layer), with
    AdamW. ``trained``: seeded random weights and one optimizer step, so the moments exist (the
    state to save); else zeroed weights and an empty optimizer (a restarted job's restore target)."""
    torch.manual_seed(0)
    with torch.device("cpu" if trained else "meta"):
        layers = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers_for(total_bytes))]
    model: torch.nn.Module = torch.nn.Sequential(*layers)
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if not trained:
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()  # touched, as initialized weights are
    if kind == "ddp":  # every rank seeded alike: no need for DDP's initial broadcast
        model = torch.nn.parallel.DistributedDataParallel(model, init_sync=False)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if trained:  # gradients that are the same on every replica, without a collective
        for p in model.parameters():
            p.grad = p.detach() * 1e-3
        optim.step()
        optim.zero_grad(set_to_none=True)
    return model, optim


def nudge(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    """A training step's change to the weights and AdamW's moments (the same on every replica),
    between saves: every tensor changes, as in training (a tensor left as it was would be referred
    to, not written again: docs/unchanged.md)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-4)
        for slots in optim.state.values():
            for name, t in slots.items():
                if name != "step":
                    t.add_(1e-6)


def fingerprint(model: torch.nn.Module, optim: torch.optim.Optimizer) -> float:
    """Sum of every parameter and AdamW moment of the whole (global) state, to check restores."""
    tensors = list(model.parameters())
    tensors += [t for slots in optim.state.values() for k, t in slots.items() if k != "step"]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    total = sum((t.detach().sum(dtype=torch.float64) for t in local), torch.zeros((), dtype=torch.float64))
    if isinstance(tensors[0], DTensor):
        dist.all_reduce(total)
    return float(total)
