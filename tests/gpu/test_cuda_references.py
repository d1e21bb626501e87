"""CUDA tensors restored through references (format version 4): a step whose frozen base refers to
an earlier step's bytes is read straight into live device memory through the pinned bounce buffers,
from the step holding them, and a damaged byte there makes restore fall back with every tensor
written again. Skipped without a CUDA device."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import crashsafe as cs
from crashsafe.errors import CorruptCheckpointWarning

from ..refsteps import commit_references

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA device (CI has none): run `bash tests/gpu/run.sh` on a GPU machine; "
        "tests/core/test_references.py reads references through a CPU upload of the same calls",
    ),
]


def _host(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _equal(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for name, value in model.state_dict().items():
        assert torch.equal(value.cpu(), expected[name]), name


def _run(directory: Path) -> tuple[nn.Module, dict[str, Any]]:
    """Steps 10 and 20 of a frozen base and a head (zstd biases); step 30 refers to step 20's base
    and owns a new head weight. Returns the model and the host values of steps 10 and 30."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 16)).cuda()
    # unchanged=False: step 20 owns its base (else it could refer to step 10's), as the tests assume
    with cs.CheckpointManager(directory, keep_last=None, codec={"*.bias": "zstd"}, unchanged=False) as mgr:
        mgr.save(10, {"model": model, "step": 10})
        mgr.wait()
        ten = _host(model)
        with torch.no_grad():
            model[2].weight.add_(1.0)
        mgr.save(20, {"model": model, "step": 20})
        mgr.wait()
    head = np.full((16, 1024), 3.0, dtype=np.float32)
    commit_references(directory, 30, 20, {"model.2.weight": head})
    thirty = {**_host(model), "2.weight": torch.from_numpy(head)}
    return model, {"ten": ten, "thirty": thirty}


def test_a_step_of_references_restores_into_live_cuda_memory_and_loads_onto_the_device(
    tmp_path: Path,
) -> None:
    model, expected = _run(tmp_path)
    memory = [p.data_ptr() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reader = cs.CheckpointManager(tmp_path, read_only=True)
        assert reader.restore({"model": model, "step": 0}) == 30
        assert [p.data_ptr() for p in model.parameters()] == memory  # read straight into live memory
        _equal(model, expected["thirty"])
        loaded = reader.load(device="cuda")["model"]
        assert all(t.is_cuda for t in loaded.values())
        assert all(torch.equal(loaded[k].cpu(), v) for k, v in expected["thirty"].items())


def test_a_damaged_referenced_byte_falls_back_and_the_live_cuda_state_ends_in_the_older_step(
    tmp_path: Path,
) -> None:
    model, expected = _run(tmp_path)
    holder = cs.CheckpointManager(tmp_path, read_only=True).manifest(20)
    weight = next(p for p in holder.payloads if p.path == "model.0.weight")
    data = tmp_path / "step_000000000020" / weight.file
    raw = bytearray(data.read_bytes())
    raw[weight.offset + weight.nbytes - 3] ^= 0x40
    data.write_bytes(bytes(raw))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cs.CheckpointManager(tmp_path, read_only=True).restore({"model": model, "step": 0}) == 10
    assert any(issubclass(w.category, CorruptCheckpointWarning) for w in caught)
    _equal(model, expected["ten"])
