"""Unchanged CUDA tensors: referred to, never copied down again, never stale (docs/unchanged.md).
The device fingerprint runs on the copy stream in the copies' order; a write torch did not count
makes the save fail, never commit stale bytes. Skipped without a CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import crashsafe as cs
from crashsafe.errors import CheckpointExistsError, SaveFailedError
from crashsafe.state.fingerprint import differs, print_of

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA device (CI has none): run `bash tests/gpu/run.sh` on a GPU machine; "
        "tests/core/test_unchanged.py checks the rule on the CPU and with the CPU device model",
    ),
]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    base = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
    for p in base.parameters():
        p.requires_grad_(False)
    return base


def _referenced(directory: Path, step: int) -> set[str]:
    with cs.CheckpointManager(directory, read_only=True) as reader:
        return {p.path for p in reader.manifest(step).payloads if p.ref is not None}


def _load(directory: Path, step: int) -> dict[str, object]:
    with cs.CheckpointManager(directory, read_only=True) as reader:
        return reader.load(step)


def _as_torch(values: dict[str, object]) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v) for k, v in values.items()}


def _equal(loaded: dict[str, torch.Tensor], live: dict[str, torch.Tensor]) -> bool:
    bits = lambda t: t.detach().cpu().reshape(-1).view(torch.uint8)  # noqa: E731
    return loaded.keys() == live.keys() and all(torch.equal(bits(loaded[k]), bits(live[k])) for k in live)


def test_fingerprint_sees_every_single_bit() -> None:
    t = torch.randn(1 << 20, device="cuda")
    before = print_of(t)
    assert not differs(t, before).item()
    raw = t.view(torch.int32)
    for index in (0, 4095, 4096 * 100 + 7, raw.numel() - 1):
        for bit in (0, 7, 31):
            raw[index] ^= 1 << bit if bit < 31 else -(1 << 31)
            assert differs(t, before).item(), (index, bit)
            raw[index] ^= 1 << bit if bit < 31 else -(1 << 31)
    assert not differs(t, before).item()


def test_frozen_cuda_weights_are_referred_to_and_restored(tmp_path: Path) -> None:
    model = _model()
    head = torch.nn.Linear(1024, 1024).cuda()
    optim = torch.optim.AdamW(head.parameters())
    with cs.CheckpointManager(tmp_path, keep_last=None) as manager:
        for step in (1, 2, 3):
            head(model(torch.randn(8, 1024, device="cuda"))).sum().backward()
            optim.step()
            manager.save(step, {"base": model, "head": head, "optim": optim})
        manager.wait()
    frozen = {f"base.{k}" for k in model.state_dict() if k.endswith("weight")}
    assert frozen <= _referenced(tmp_path, 3)
    assert not {p for p in _referenced(tmp_path, 3) if p.startswith("head.")}
    fresh = _model()
    for p in fresh.parameters():
        p.data.zero_()
    with cs.CheckpointManager(tmp_path, read_only=True) as reader:
        state = {"base": fresh, "head": torch.nn.Linear(1024, 1024).cuda(), "optim": None}
        state["optim"] = torch.optim.AdamW(state["head"].parameters())
        assert reader.restore(state) == 3
    assert _equal(fresh.state_dict(), model.state_dict())


def test_a_kernel_queued_before_save_is_seen(tmp_path: Path) -> None:
    """An in-place kernel through .data (no version bump) queued right before save: the fingerprint
    runs after it on the GPU, so the save fails loudly instead of referring to the old bytes."""
    model = _model()
    weight = model[0].weight
    with cs.CheckpointManager(tmp_path, keep_last=None) as manager:
        manager.save(1, {"base": model})
        manager.save(2, {"base": model})
        manager.wait()
        weight.data.mul_(-1)  # queued, not yet run when save returns
        manager.save(3, {"base": model})
        with pytest.raises(SaveFailedError, match="version counter"):
            manager.wait()
        manager.save(4, {"base": model})  # copies everything: right again
        manager.wait()
        assert 3 not in manager.steps()
    assert _referenced(tmp_path, 4) == set()
    assert _equal(_as_torch(_load(tmp_path, 4)["base"]), model.state_dict())


def test_kernels_after_save_never_reach_a_reference(tmp_path: Path) -> None:
    model = _model()
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with cs.CheckpointManager(tmp_path, keep_last=None) as manager:
        manager.save(1, {"base": model})
        manager.save(2, {"base": model})
        manager.save(3, {"base": model})
        for p in model.parameters():
            p.data.add_(1.0)  # after save returned: must not reach step 3
        manager.wait()
    assert _equal(_as_torch(_load(tmp_path, 3)["base"]), expected)


def test_a_save_refused_after_its_copy_leaves_no_stale_buffer(tmp_path: Path) -> None:
    """As in tests/core/test_unchanged.py, on the GPU: the refused save's copy into the pinned buffer
    that held the committed bytes lands; swapped back, the tensor's fingerprint matches, and with the
    step holding its bytes gone the next save must not write that buffer."""
    model = _model()
    weight = model[0].weight
    with cs.CheckpointManager(tmp_path, keep_last=None) as manager:
        manager.save(1, {"base": model})
        manager.wait()
        original = weight.data
        weight.data = torch.randn_like(weight)  # an EMA swap: other memory, the same version
        with pytest.raises(CheckpointExistsError):
            manager.save(1, {"base": model})
        torch.cuda.synchronize()
        weight.data = original
        manager.delete([1])
        expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
        manager.save(2, {"base": model})
        manager.wait()
    assert _equal(_as_torch(_load(tmp_path, 2)["base"]), expected)


def test_the_buffer_a_first_save_landed_in_holds_its_bytes(tmp_path: Path) -> None:
    """A first save clones each tensor on the device and lands it in pinned memory later; that
    buffer is what a save writes for an unchanged tensor whose holding step is gone."""
    model = _model()
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with cs.CheckpointManager(tmp_path, keep_last=None) as manager:
        manager.save(1, {"base": model})
        manager.wait()
        manager.delete([1])
        manager.save(2, {"base": model})
        manager.wait()
    assert _referenced(tmp_path, 2) == set()
    assert _equal(_as_torch(_load(tmp_path, 2)["base"]), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.bool, torch.int8, torch.complex64])
def test_one_bit_flipped_behind_torch_fails_the_save(tmp_path: Path, dtype: torch.dtype) -> None:
    values = torch.randn(1 << 18, device="cuda")
    tensor = (values > 0) if dtype == torch.bool else values.to(dtype)
    tensor = torch.cat([tensor, tensor[:37]])  # bytes that fill no row: the print's tail
    with cs.CheckpointManager(tmp_path, keep_last=None) as manager:
        for step in (1, 2, 3):  # copied twice (found steady in between), then referred to
            manager.save(step, {"t": tensor})
        manager.wait()
        assert _referenced(tmp_path, 3) == {"t"}
        tensor.data.view(-1).view(torch.uint8)[-1] ^= 1  # the last byte's lowest bit, uncounted
        manager.save(4, {"t": tensor})
        with pytest.raises(SaveFailedError, match="version counter"):
            manager.wait()
