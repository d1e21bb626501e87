"""The memory tier with CUDA tensors (docs/memory.md): a memory step holds what the state was at
``save``, whatever kernels are queued behind it (rule 15: the memory step and the persistent one come
from the same pinned staging); a restore from memory goes back into live CUDA tensors bit-identical,
and a wiped memory directory falls back to the persistent tier. Skipped without a CUDA device; the
two-rank CUDA job is tests/distributed/test_memory_tier_ranks.py's ``ddp-cuda``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import crashsafe as cs
from crashsafe.storage.layout import committed_steps

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA device (CI has none): run `bash tests/gpu/run.sh` on a GPU machine; "
        "tests/core/test_memory_tier.py checks the same on the CPU",
    ),
]

BIG = 32 << 20  # elements: a 128 MiB fp32 tensor takes milliseconds to copy, so a race would show


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().reshape(-1).view(torch.uint8)


def test_kernels_queued_right_after_a_memory_save_never_reach_the_memory_step(tmp_path: Path) -> None:
    tier = cs.MemoryTier(tmp_path / "mem", persist_every=3, keep_last=5)
    with cs.CheckpointManager(tmp_path / "disk", keep_last=None, memory=tier) as mgr:
        w = torch.zeros(BIG, device="cuda")
        for step in range(1, 7):
            w.fill_(float(step))
            mgr.save(step, {"w": w})
            for _ in range(3):  # in place, right behind the save, before any sync
                w.add_(1000.0)
                w.mul_(-1.0)
        mgr.wait()
    torch.cuda.synchronize()
    assert committed_steps(tmp_path / "disk") == [3, 6]
    for step in (6, 5, 4, 3, 2):  # the memory tier keeps 5 (a restore drops the newer ones)
        tier_only = cs.MemoryTier(tmp_path / "mem", persist_every=3, keep_last=5)
        with cs.CheckpointManager(tmp_path / f"empty-{step}", memory=tier_only) as reader:
            state = {"w": torch.empty(BIG, device="cuda")}
            assert reader.restore(state, step=step) == step
            assert reader.recovery is not None and reader.recovery.source == "memory"
            held = bool((state["w"] == float(step)).all())
            assert held, f"memory step {step} holds values written after save"


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 64)).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        optim.zero_grad()
        model(torch.randn(32, 256, device="cuda")).pow(2).mean().backward()
        optim.step()


def test_a_live_cuda_model_restores_from_memory_bit_identical_and_from_disk_once_memory_is_wiped(
    tmp_path: Path,
) -> None:
    tier = cs.MemoryTier(tmp_path / "mem", persist_every=4)
    model, optim = _model()
    with cs.CheckpointManager(tmp_path / "disk", memory=tier) as mgr:
        for step in range(1, 7):
            _train(model, optim, 2)
            mgr.save(step, {"model": model, "optim": optim})
            if step == 4:
                mgr.wait()
                at_four = [_bits(v).clone() for v in model.state_dict().values()]
        mgr.wait()
    saved = [_bits(v) for v in (*model.state_dict().values(), *optim.state_dict()["state"][0].values())]

    fresh, fresh_optim = _model()
    _train(fresh, fresh_optim, 1)  # live CUDA state that differs everywhere
    with cs.CheckpointManager(tmp_path / "disk", memory=tier) as mgr:
        assert mgr.restore({"model": fresh, "optim": fresh_optim}) == 6
        assert mgr.recovery is not None and mgr.recovery.source == "memory"
    got = [_bits(v) for v in (*fresh.state_dict().values(), *fresh_optim.state_dict()["state"][0].values())]
    assert all(torch.equal(a, b) for a, b in zip(saved, got, strict=True))
    assert all(p.is_cuda for p in fresh.parameters())

    shutil.rmtree(tmp_path / "mem")  # the host lost its memory: the persistent step 4 remains
    again, again_optim = _model()
    with cs.CheckpointManager(tmp_path / "disk", memory=tier) as mgr:
        assert mgr.restore({"model": again, "optim": again_optim}) == 4
        assert mgr.recovery is not None and mgr.recovery.source == "persistent"
    assert all(torch.equal(a, _bits(b)) for a, b in zip(at_four, again.state_dict().values(), strict=True))
