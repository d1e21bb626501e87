"""A CPU model of CUDA staging, for tests of the ordering rules on machines without a GPU (CI).

Tensors marked with :func:`on_device` count as CUDA tensors. A queued device copy takes the source's
values when it is *issued* (the GPU orders it after the work queued before ``save`` and before what
comes after), but lands in its staging buffer only when someone waits for it (``ready``/``wait``),
as a non-blocking copy on a busy copy stream would. A reader that does not wait reads whatever the
buffer held before. Clones of first-seen tensors work the same way. The real CUDA path is tested on a
GPU by ``tests/gpu/``; this model checks, everywhere, that every reader waits where it must.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import crashsafe.saving
import crashsafe.state.staging


def on_device(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor`` as a CUDA tensor of the model."""
    tensor._fake_cuda = True  # type: ignore[attr-defined]
    return tensor


def _is_cuda(value: Any) -> bool:
    return bool(getattr(value, "_fake_cuda", False))


class _Copies:
    """DeviceCopies of the model: copies land only when waited for."""

    def __init__(self) -> None:
        self.queued: list[tuple[int, Any, Any]] = []
        self.issued: list[tuple[int, Any, Any]] = []
        self.count = 0

    def add(self, target: Any, source: Any) -> int:
        ticket, self.count = self.count, self.count + 1
        self.queued.append((ticket, target, source))
        return ticket

    def run(self, device: Any, work: Any, keep: Any) -> int:
        ticket, self.count = self.count, self.count + 1
        self.queued.append((ticket, work, None))
        return ticket

    def clone_of(self, source: Any) -> tuple[Any, int]:
        clone = on_device(torch.full_like(source, float("nan")) if source.is_floating_point() else source * 0)
        return clone, self.add(clone, source)

    def issue(self, *, ordered: bool = True) -> None:
        for _, target, _ in self.queued:  # work (fingerprints) reads the values as of now, as a copy does
            if callable(target):
                target()
        copies = [(t, target, source) for t, target, source in self.queued if not callable(target)]
        self.issued += [(t, target, source.detach().clone()) for t, target, source in copies]
        self.queued.clear()

    def ready(self, ticket: int) -> None:
        for _, target, values in [c for c in self.issued if c[0] <= ticket]:
            target.copy_(values)
        self.issued = [c for c in self.issued if c[0] > ticket]

    def wait(self) -> None:
        self.ready(self.count)


@pytest.fixture
def fake_device(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Swap the CUDA parts of staging for the model; yields :func:`on_device`."""
    monkeypatch.setattr(crashsafe.state.staging, "is_cuda", _is_cuda)
    monkeypatch.setattr(crashsafe.saving, "is_cuda", _is_cuda)
    monkeypatch.setattr(crashsafe.state.staging, "DeviceCopies", _Copies)
    monkeypatch.setattr(crashsafe.state.staging, "device_room", lambda device: 1 << 40)
    monkeypatch.setattr(crashsafe.state.staging, "pinned_buffer", lambda n: torch.zeros(n, dtype=torch.uint8))
    # a CPU tensor takes snapshot.py's CPU path; a CUDA tensor goes through pool.stage(): so must these
    monkeypatch.setattr(crashsafe.state.staging.StagingPool, "staged", lambda self, path, dtype, shape: None)
    return on_device
