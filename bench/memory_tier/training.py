"""What the memory tier benchmark's ranks share: the pretended hosts, the training step of the
distributed bench's MLP (bench/distributed/model.py), and the state's local tensors."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from bench.distributed.model import WIDTH


def host_of(rank: int, world: int) -> str:
    """Rank ``rank``'s pretended host: the first half of the ranks on host "a", the rest on "b"."""
    return "a" if rank < max(1, world // 2) else "b"


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, seed: int, batch: int) -> None:
    """One real training step: forward and backward of a batch (drawn from ``seed``), the gradient
    all-reduce (DDP) or FSDP2's all-gathers and reduce-scatters, and AdamW's step."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, WIDTH, generator=g)
    optim.zero_grad(set_to_none=True)
    (model(x) - x).pow(2).mean().backward()
    optim.step()


def local_tensors(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's part of the state, in a fixed order: parameters, then AdamW's moments and step
    counts (FSDP2: the local shards)."""
    params = list(model.parameters())
    tensors = params + [optim.state[p][k] for p in params for k in sorted(optim.state.get(p, {}))]
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def same(left: list[torch.Tensor], right: list[torch.Tensor]) -> bool:
    """Bit-identical lists of tensors (NaN payloads included)."""
    if len(left) != len(right):
        return False
    for a, b in zip(left, right, strict=True):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        a8 = a.detach().contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(a8, b.detach().contiguous().reshape(-1).view(torch.uint8)):
            return False
    return True
