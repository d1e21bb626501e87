"""CUDA tensors: snapshots ordered on the GPU (never torn by kernels launched after ``save``), every
dtype and layout staged exactly, restore and ``load(device=)`` straight into device memory, and the
fallback from a damaged step into live CUDA tensors. Skipped without a CUDA device."""

from __future__ import annotations

import os
import socket
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import crashsafe as cs
from crashsafe.errors import CorruptCheckpointWarning, CrashsafeWarning

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA device (CI has none): run `bash tests/gpu/run.sh` on a GPU machine; "
        "tests/core/test_device_staging.py checks the same ordering on the CPU",
    ),
]

BIG = 64 << 20  # elements: a 256 MiB fp32 tensor takes milliseconds to copy, so a race would show


def _host(value: Any) -> Any:
    """A synchronous host copy of every tensor in a nested state (the expected values)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _host(v) for k, v in value.items()}
    return value


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu(), b.detach().cpu()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _bytes_equal(loaded: dict[str, Any], expected: dict[str, Any]) -> None:
    for key, value in expected.items():
        if isinstance(value, dict):
            _bytes_equal(loaded[key], value)
        else:
            got = loaded[key]
            flat = lambda t: t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)  # noqa: E731
            assert got.dtype == value.dtype and got.shape == value.shape, key
            assert torch.equal(flat(got.cpu().contiguous()), flat(value.contiguous())), key


@pytest.mark.parametrize("side_stream", [False, True], ids=["default-stream", "side-stream"])
def test_kernels_launched_right_after_save_never_reach_the_checkpoint(
    tmp_path: Path, side_stream: bool
) -> None:
    """In-place kernels queued right behind ``save`` (first save: device clones; later: pinned
    copies) run after the copy on the GPU; work queued before ``save`` runs before it."""
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream), cs.CheckpointManager(tmp_path, keep_last=None) as mgr:
        w = torch.zeros(BIG, device="cuda")
        other = torch.zeros(1024, 1024, device="cuda")
        for step in range(1, 6):
            for _ in range(4):  # pending work before save: the copy must see its result
                other = other @ torch.eye(1024, device="cuda")
            w.fill_(float(step))
            mgr.save(step, {"w": w, "other": other})
            for _ in range(3):  # in place, right behind the save, before any sync
                w.add_(1000.0)
                w.mul_(-1.0)
        mgr.wait()
        torch.cuda.synchronize()
        for step in range(1, 6):
            loaded = mgr.load(step)["w"]
            assert bool((loaded == float(step)).all()), f"step {step} holds values written after save"


def test_a_tensor_freed_right_after_save_keeps_its_values_until_copied(tmp_path: Path) -> None:
    """The caching allocator never hands a tensor's memory to new work before its copy is done."""
    with cs.CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in range(1, 4):
            temporary = torch.full((BIG,), float(step), device="cuda")
            mgr.save(step, {"t": temporary})
            del temporary
            junk = torch.empty(BIG, device="cuda")  # the freed block, if it were free
            junk.fill_(-1.0)
        mgr.wait()
        for step in range(1, 4):
            assert bool((mgr.load(step)["t"] == float(step)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                   torch.int64, torch.bool, torch.complex64])  # fmt: skip
def test_every_dtype_and_layout_is_staged_exactly(tmp_path: Path, dtype: torch.dtype) -> None:
    base = torch.randn(300, 200, device="cuda").to(dtype)
    state = {
        "plain": base,
        "transposed": base.t(),  # non-contiguous, a view of a tensor saved beside it
        "strided": torch.randn(50, 40, device="cuda").to(dtype)[::2, 1::3],
        "empty": torch.empty(0, 7, device="cuda", dtype=dtype),
        "scalar": torch.ones((), device="cuda").to(dtype),
        "cpu": torch.arange(10),
    }
    with cs.CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in range(3):  # first save (clones), then pinned buffers, reused
            expected = _host(state)
            mgr.save(step, state)
            state["plain"].copy_(torch.randn(300, 200, device="cuda").to(dtype))
            state["strided"] = torch.randn(50, 40, device="cuda").to(dtype)[::2, 1::3]
        mgr.wait()
        last = mgr.load(2)
        _bytes_equal(last, expected)
        assert mgr._pool is not None and mgr._pool.pinned_nbytes > 0  # staged in pinned memory


def test_a_model_and_optimizer_restore_in_place_and_load_onto_the_device(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 512, device="cuda")).sum().backward()
    optimizer.step()
    state = {"model": model, "optim": optimizer, "step": 1}
    expected = _host({"model": model.state_dict(), "optim": optimizer.state_dict()["state"]})
    with cs.CheckpointManager(tmp_path, codec={"*.bias": "zstd"}) as mgr:
        mgr.save(1, state)
        mgr.wait()
        memory = [p.data_ptr() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(3.0)
        for moments in optimizer.state.values():
            moments["exp_avg"].zero_()
        assert mgr.restore(state) == 1
        assert [p.data_ptr() for p in model.parameters()] == memory  # read straight into the live memory
        _bytes_equal({"model": model.state_dict(), "optim": optimizer.state_dict()["state"]}, expected)
        loaded = mgr.load(device="cuda")
        assert all(t.is_cuda for t in loaded["model"].values())
        _bytes_equal({"model": loaded["model"], "optim": loaded["optim"]["state"]}, expected)


def test_a_damaged_step_falls_back_and_the_live_cuda_state_ends_in_the_older_step(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024)).cuda()
    with cs.CheckpointManager(tmp_path, keep_last=None) as mgr:
        mgr.save(1, {"model": model})
        mgr.wait()
        older = _host(model.state_dict())
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        mgr.save(2, {"model": model})
        mgr.wait()
    data = next((tmp_path / "step_000000000002").glob("*.bin"))
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0x40  # the last payload's bytes: read after the others went into live memory
    data.write_bytes(bytes(raw))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    with (
        warnings.catch_warnings(record=True) as caught,
        cs.CheckpointManager(tmp_path, read_only=True) as reader,
    ):
        warnings.simplefilter("always")
        assert reader.restore({"model": model}) == 1
    assert any(issubclass(w.category, CorruptCheckpointWarning) for w in caught)
    for name, value in model.state_dict().items():
        assert _same(value, older[name]), name


def test_beyond_the_pinned_cap_tensors_stage_in_pageable_memory_with_one_warning(tmp_path: Path) -> None:
    state = {f"t{i}": torch.full((1 << 20,), float(i), device="cuda") for i in range(4)}
    with (
        pytest.warns(CrashsafeWarning, match="pinned_bytes"),
        cs.CheckpointManager(tmp_path, pinned_bytes=1 << 20) as mgr,
    ):
        for step in range(3):
            mgr.save(step, state)
        mgr.wait()
        loaded = mgr.load(2)
    for key, value in state.items():
        assert _same(loaded[key], value)


def test_fsdp2_on_a_one_rank_nccl_group_saves_and_restores(tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        torch.manual_seed(2)
        model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)).cuda()
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(4, 256, device="cuda")).sum().backward()
        optimizer.step()
        state = {"model": model, "optim": optimizer}
        expected = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
        with cs.CheckpointManager(tmp_path) as mgr:
            mgr.save(1, state)
            mgr.wait()
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            assert mgr.restore(state) == 1
        for key, value in model.state_dict().items():
            assert _same(value.full_tensor(), expected[key]), key
    finally:
        dist.destroy_process_group()
