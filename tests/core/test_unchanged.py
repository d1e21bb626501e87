"""Unchanged tensors are referred to, never copied or written again, and never stale (rule 16).

Every way we found to change a tensor's bytes, torch's version counter seeing it or not, is applied
between saves (and right after a save returns, before it is written); each save's checkpoint must
load back exactly as the state was at the save point.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import crashsafe as cs
from crashsafe.errors import CheckpointExistsError, SaveFailedError
from crashsafe.format.manifest import Manifest, PayloadEntry
from crashsafe.state.unchanged import MIN_BYTES, ChangeWatch

from ..fake_device import fake_device

__all__ = ["fake_device"]

ROWS, COLS = 64, 512  # 128 KiB of float32: big enough to be watched


def _model(seed: int = 0, frozen: int = 4) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(COLS, ROWS, bias=False) for _ in range(frozen)])
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _loaded(directory: Path, step: int) -> dict[str, torch.Tensor]:
    with cs.CheckpointManager(directory, read_only=True) as reader:
        state = reader.load(step)
    return {k: torch.as_tensor(v) for k, v in state["model"].items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    bits = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    return a.keys() == b.keys() and all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


def _referenced(directory: Path, step: int) -> set[str]:
    with cs.CheckpointManager(directory, read_only=True) as reader:
        return {p.path for p in reader.manifest(step).payloads if p.ref is not None}


# ----------------------------------------------------------------------------- mutations


def _other(t: torch.Tensor) -> torch.Tensor:
    return torch.randn_like(t)


def _in_place(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.add_(1.0)


def _through_data(t: torch.Tensor) -> None:
    t.data.mul_(-1.5)  # a new version counter: torch's own is not moved


def _through_numpy(t: torch.Tensor) -> None:
    t.detach().numpy()[3, :7] = 42.0


def _through_dlpack(t: torch.Tensor) -> None:
    alias = torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(t.detach()))
    alias[0, 0] = -7.0


def _through_storage(t: torch.Tensor) -> None:
    t.untyped_storage().fill_(3)


def _through_pointer(t: torch.Tensor) -> None:
    ctypes.memset(t.data_ptr() + 100, 0x41, 8)  # one float's worth of bytes, from C


def _replaced_storage(t: torch.Tensor) -> None:
    t.data = _other(t)  # set_: the same object, other memory


def _same_value_through_data(t: torch.Tensor) -> None:
    t.data.copy_(t.detach().clone())  # bytes unchanged: a reference stays right


def _one_bit(t: torch.Tensor) -> None:
    t.detach().view(torch.int32).numpy().reshape(-1)[-1] ^= 1  # the last element's lowest bit


def _child_process(t: torch.Tensor) -> None:
    """A write from another process into shared memory: nothing in this process sees it."""
    t.share_memory_()
    process = multiprocessing.get_context("fork").Process(target=_negate_in_child, args=(t,))
    process.start()
    process.join(30)
    assert process.exitcode == 0


def _negate_in_child(t: torch.Tensor) -> None:
    t.detach().numpy()[:] *= -1


MUTATIONS: dict[str, Callable[[torch.Tensor], None]] = {
    "in_place": _in_place,
    "data": _through_data,
    "numpy": _through_numpy,
    "dlpack": _through_dlpack,
    "storage": _through_storage,
    "pointer": _through_pointer,
    "set_": _replaced_storage,
    "same_value": _same_value_through_data,
    "one_bit": _one_bit,
}


def _load_state_dict(model: torch.nn.Module) -> None:
    model.load_state_dict({k: _other(v) for k, v in model.state_dict().items()})


def _load_state_dict_assign(model: torch.nn.Module) -> None:
    model.load_state_dict({k: _other(v) for k, v in model.state_dict().items()}, assign=True)


def _replaced_parameter(model: torch.nn.Module) -> None:
    layer = model[0]
    assert isinstance(layer, torch.nn.Linear)
    layer.weight = torch.nn.Parameter(_other(layer.weight), requires_grad=False)


def _swapped(model: torch.nn.Module) -> None:
    a, b = model[0].weight, model[1].weight
    a.data, b.data = b.data, a.data


MODEL_MUTATIONS: dict[str, Callable[[torch.nn.Module], None]] = {
    "load_state_dict": _load_state_dict,
    "load_state_dict_assign": _load_state_dict_assign,
    "replaced_parameter": _replaced_parameter,
    "swapped": _swapped,
}


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("async_save", [True, False])
def test_frozen_tensors_are_referred_to_and_load_back(tmp_path: Path, async_save: bool) -> None:
    model = _model()
    with cs.CheckpointManager(tmp_path, async_save=async_save, keep_last=None) as manager:
        for step in (1, 2, 3):
            manager.save(step, {"model": model})
        manager.wait()
        sizes = [manager.manifest(step).stored_nbytes for step in (1, 2, 3)]
    assert _referenced(tmp_path, 1) == set()
    assert _referenced(tmp_path, 2) == _referenced(tmp_path, 3) == {f"model.{k}" for k in model.state_dict()}
    assert sizes[1] == sizes[2] == 0 and sizes[0] >= 4 * MIN_BYTES  # nothing written again
    for step in (1, 2, 3):
        assert _same(_loaded(tmp_path, step), _values(model))


def test_turned_off_copies_and_writes_every_tensor(tmp_path: Path) -> None:
    model = _model()
    with cs.CheckpointManager(tmp_path, unchanged=False) as manager:
        for step in (1, 2):
            manager.save(step, {"model": model})
    assert _referenced(tmp_path, 2) == set()


def test_small_tensors_are_always_copied(tmp_path: Path) -> None:
    small = torch.zeros(8, 8)
    with cs.CheckpointManager(tmp_path) as manager:
        for step in (1, 2):
            manager.save(step, {"small": small})
    assert _referenced(tmp_path, 2) == set()


@pytest.mark.parametrize("async_save", [True, False])
@pytest.mark.parametrize("how", sorted(MUTATIONS))
def test_a_mutation_before_the_save_is_saved(tmp_path: Path, how: str, async_save: bool) -> None:
    model = _model()
    with cs.CheckpointManager(tmp_path, async_save=async_save, keep_last=None) as manager:
        manager.save(1, {"model": model})
        manager.save(2, {"model": model})  # every tensor referred to from here on
        MUTATIONS[how](model[1].weight)
        expected = _values(model)
        manager.save(3, {"model": model})
        manager.wait()
    assert _same(_loaded(tmp_path, 3), expected)
    changed = how != "same_value"
    assert ("model.1.weight" in _referenced(tmp_path, 3)) != changed
    others = {"model.0.weight", "model.2.weight", "model.3.weight"}
    assert others <= _referenced(tmp_path, 3)  # the others still are


@pytest.mark.parametrize("how", sorted(MODEL_MUTATIONS))
def test_a_mutation_of_the_module_is_saved(tmp_path: Path, how: str) -> None:
    model = _model()
    with cs.CheckpointManager(tmp_path, keep_last=None) as manager:
        manager.save(1, {"model": model})
        manager.save(2, {"model": model})
        MODEL_MUTATIONS[how](model)
        expected = _values(model)
        manager.save(3, {"model": model})
        manager.wait()
    assert _same(_loaded(tmp_path, 3), expected)


def test_changed_and_changed_back_around_a_save(tmp_path: Path) -> None:
    """An EMA swap through .data: other values at the save point, the old ones right after save
    returns. The step must hold the values of the save point, not the old ones it may refer to."""
    model = _model()
    weight = model[0].weight
    with cs.CheckpointManager(tmp_path, keep_last=None) as manager:
        manager.save(1, {"model": model})
        manager.save(2, {"model": model})
        kept = weight.detach().clone()
        weight.data.copy_(_other(weight))
        expected = _values(model)
        manager.save(3, {"model": model})
        weight.data.copy_(kept)  # before the background writer runs
        manager.wait()
    assert _same(_loaded(tmp_path, 3), expected)


def test_a_failed_save_makes_the_next_one_copy_everything(tmp_path: Path) -> None:
    model = _model()
    with cs.CheckpointManager(tmp_path, keep_last=None) as manager:
        manager.save(1, {"model": model})
        manager.save(2, {"model": model})
        manager.wait()
        manager._planner.reset()  # what a failed save or damage found on a read does
        manager.save(3, {"model": model})
        manager.wait()
    assert _referenced(tmp_path, 3) == set()
    assert _same(_loaded(tmp_path, 3), _values(model))


def test_a_save_refused_after_its_copy_leaves_no_stale_buffer(tmp_path: Path) -> None:
    """A save refused in the save call (a step number already committed) has copied a swapped-in
    tensor into the buffer that held the committed bytes. Swapped back (.data: same memory and
    version as the record), the tensor is proven unchanged; once the step holding its bytes is gone,
    the next save writes that buffer, which must still hold them, not the refused save's."""
    model = _model()
    weight = model[0].weight
    with cs.CheckpointManager(tmp_path, keep_last=None) as manager:
        manager.save(1, {"model": model})
        manager.wait()
        original = weight.data
        weight.data = _other(weight)  # an EMA swap: other memory, torch's version counter unmoved
        with pytest.raises(CheckpointExistsError):
            manager.save(1, {"model": model})
        weight.data = original
        manager.delete([1])
        expected = _values(model)
        manager.save(2, {"model": model})
        manager.wait()
    assert _same(_loaded(tmp_path, 2), expected)


class _SwapsOnce:
    """A stateful object whose second ``state_dict()`` swaps other values into a tensor through
    .data (torch's version counter unmoved), as a save walks the state after that tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.calls = tensor, 0

    def state_dict(self) -> dict[str, Any]:
        self.calls += 1
        if self.calls == 2:
            self.tensor.data.copy_(_other(self.tensor))
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@pytest.mark.parametrize("codec", [None, "zstd"], ids=["raw", "zstd"])
def test_a_tensor_written_by_a_later_state_dict_is_hashed_where_it_is_copied(
    tmp_path: Path, codec: str | None
) -> None:
    """A save copies a tensor after the state_dict() of objects later in the state: its hash must be
    taken there too. Hashed before, a zstd step held the swapped values under the hash of the old
    ones, and the next save, the old values back, referred to the swapped ones."""
    torch.manual_seed(0)
    weight = torch.randn(ROWS, COLS)
    state = {"a": weight, "z": _SwapsOnce(weight)}
    with cs.CheckpointManager(tmp_path, keep_last=None, codec=codec) as manager:
        manager.save(1, state)
        manager.wait()
        before = weight.clone()
        manager.save(2, state)  # the walk's state_dict() swaps other values in, which a copy takes
        manager.wait()
        swapped = weight.clone()
        weight.data.copy_(before)
        manager.save(3, state)
        manager.wait()
    assert not torch.equal(before, swapped)
    assert torch.equal(torch.as_tensor(manager.load(2)["a"]), swapped)
    assert torch.equal(torch.as_tensor(manager.load(3)["a"]), before)


def test_tensors_of_other_devices_are_copied_never_hashed() -> None:
    """An MPS or XPU tensor (a meta tensor stands for them: no such device here) is copied by staging
    like a CPU one, but its bytes cannot be viewed on the host: the watch must not try to hash it
    (it did at the second save, which raised a TypeError from .numpy())."""
    tensor = torch.empty(ROWS, COLS, device="meta")
    buffer = np.zeros((ROWS, COLS), dtype=np.float32)
    raw = {"id": "raw"}
    entry = PayloadEntry("t", "torch", "float32", (ROWS, COLS), "data.bin", 0, MIN_BYTES, "0" * 16, raw)
    watch = ChangeWatch()
    watch.begin()
    watch.saw("t", tensor, buffer=buffer)
    watch.committed(Manifest(1, 1.0, {}, (entry,), {"data.bin": MIN_BYTES}), None)
    watch.begin()
    assert watch.check("t", tensor, held=buffer, live=False) is None
    assert watch.check("t", tensor, held=None, live=True) is None


@pytest.mark.parametrize("codec", ["zstd", "incremental"])
def test_a_sync_save_writes_an_unchanged_tensor_as_its_own_type(tmp_path: Path, codec: str) -> None:
    """A save that writes before it returns gives the writer the live tensor where the step holding
    its committed bytes is gone. Given as flat bytes, a codec that shuffles by element size stored
    them unshuffled under the tensor's dtype: checksums fine, values wrong."""
    model = _model()
    with cs.CheckpointManager(tmp_path, keep_last=None, async_save=False, codec=codec) as manager:
        manager.save(1, {"model": model})
        manager.save(2, {"model": model})  # hashed as its copy is: referred to from the next save
        manager.delete([2, 1])
        manager.save(3, {"model": model})
    assert _same(_loaded(tmp_path, 3), _values(model))


def test_inference_tensors_are_always_copied(tmp_path: Path) -> None:
    with torch.inference_mode():
        frozen = torch.randn(ROWS, COLS)
    with cs.CheckpointManager(tmp_path) as manager:
        for step in (1, 2):
            manager.save(step, {"t": frozen})
    assert _referenced(tmp_path, 2) == set()


_KINDS = sorted(MUTATIONS)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rounds=st.lists(
        st.tuples(
            st.lists(st.tuples(st.integers(0, 3), st.sampled_from(_KINDS)), max_size=3),  # before the save
            st.lists(st.tuples(st.integers(0, 3), st.sampled_from(_KINDS)), max_size=2),  # right after it
            st.booleans(),  # wait for the save before mutating again
        ),
        min_size=1,
        max_size=6,
    ),
    async_save=st.booleans(),
)
def test_random_mutations_never_leave_a_stale_step(
    tmp_path_factory: pytest.TempPathFactory, rounds: list[Any], async_save: bool
) -> None:
    directory = tmp_path_factory.mktemp("mutations")
    model = _model()
    weights = [model[i].weight for i in range(4)]
    expected: dict[int, dict[str, torch.Tensor]] = {}
    with cs.CheckpointManager(directory, async_save=async_save, keep_last=None) as manager:
        for step, (before, after, wait) in enumerate(rounds, start=1):
            for i, kind in before:
                MUTATIONS[kind](weights[i])
                weights = [model[j].weight for j in range(4)]
            expected[step] = _values(model)
            manager.save(step, {"model": model})
            for i, kind in after:
                MUTATIONS[kind](weights[i])
            if wait:
                manager.wait()
        manager.wait()
    for step, values in expected.items():
        assert _same(_loaded(directory, step), values), f"step {step} is stale"


def test_numpy_arrays_are_copied_as_before(tmp_path: Path) -> None:
    array = np.ones((ROWS, COLS), dtype=np.float32)
    with cs.CheckpointManager(tmp_path) as manager:
        for step in (1, 2):
            manager.save(step, {"a": array})
    assert _referenced(tmp_path, 2) == set()


# ----------------------------------------------------------------------------- the device path (CPU model)


def test_device_tensors_are_proven_by_their_fingerprint(tmp_path: Path, fake_device: Any) -> None:
    """Tensors of the CPU device model take the CUDA path: fingerprints queued with the copies,
    compared when issued (at the save point), checked by the writer."""
    torch.manual_seed(0)
    weights = {f"{i}": fake_device(torch.randn(ROWS, COLS)) for i in range(3)}
    with cs.CheckpointManager(tmp_path, keep_last=None) as manager:
        for step in (1, 2, 3):
            manager.save(step, {"model": weights})
        manager.wait()
        assert _referenced(tmp_path, 3) == {f"model.{k}" for k in weights}
        expected = {k: v.clone() for k, v in weights.items()}
        weights["1"].data.mul_(2)  # torch does not count it: the fingerprint does
        manager.save(4, {"model": weights})
        with pytest.raises(SaveFailedError, match="version counter"):
            manager.wait()
        assert manager.steps() == [1, 2, 3]
        manager.save(5, {"model": weights})  # copies every tensor after the failure
        manager.wait()
    assert _referenced(tmp_path, 5) == set()
    assert _same(_loaded(tmp_path, 3), expected)
    assert _same(_loaded(tmp_path, 5), {k: v.clone() for k, v in weights.items()})


def test_a_fused_optimizer_on_the_device_never_fails_a_save(tmp_path: Path, fake_device: Any) -> None:
    """A fused optimizer writes its state (and the parameters) without moving torch's version
    counter, at every step. Proven unchanged by the counter alone, such a device tensor was not
    copied, its fingerprint differed, and every save after a full one failed. A device tensor is
    now proven only once found steady over an interval: the frozen base is still referred to."""
    torch.manual_seed(0)
    base = {f"{i}": fake_device(torch.randn(ROWS, COLS)) for i in range(2)}
    head = torch.nn.Linear(COLS, ROWS)
    optim = torch.optim.AdamW(head.parameters(), fused=True)
    with cs.CheckpointManager(tmp_path, keep_last=None) as manager:
        for step in range(1, 6):
            head(torch.randn(8, COLS)).sum().backward()
            optim.step()
            state = {"base": base, "optim": {k: fake_device(v) for k, v in optim.state[head.weight].items()}}
            expected = {k: v.clone() for k, v in state["optim"].items()}
            manager.save(step, state)
            manager.wait()
            loaded = manager.load(step)["optim"]
            assert all(torch.equal(torch.as_tensor(loaded[k]), v) for k, v in expected.items())
        assert {"base.0", "base.1"} <= _referenced(tmp_path, 5)


def test_shared_memory_written_by_another_process(tmp_path: Path) -> None:
    model = _model()
    for p in model.parameters():
        p.share_memory_()
    with cs.CheckpointManager(tmp_path, keep_last=None) as manager:
        manager.save(1, {"model": model})
        manager.save(2, {"model": model})
        _child_process(model[2].weight)
        expected = _values(model)
        manager.save(3, {"model": model})
        manager.wait()
    assert "model.2.weight" not in _referenced(tmp_path, 3)
    assert _same(_loaded(tmp_path, 3), expected)


@pytest.mark.parametrize("codec", ["incremental", {"head.*": "lc"}], ids=["incremental", "lc-on-the-head"])
def test_codecs_on_the_changing_part_while_the_base_is_referred_to(tmp_path: Path, codec: Any) -> None:
    """A delta codec on every path, or a lossy one on the trained part: the frozen base is referred
    to, and the changing part is saved exactly as it is with references turned off."""
    loads: dict[bool, list[dict[str, Any]]] = {}
    for unchanged in (True, False):
        base = _model()
        torch.manual_seed(1)
        head = torch.nn.Linear(COLS, COLS)
        optim = torch.optim.SGD(head.parameters(), lr=0.1)
        directory = tmp_path / str(unchanged)
        with cs.CheckpointManager(directory, codec=codec, keep_last=None, unchanged=unchanged) as manager:
            for step in range(1, 6):
                head(torch.randn(4, COLS)).sum().backward()
                optim.step()
                manager.save(step, {"model": base, "head": head})
            manager.wait()
        with cs.CheckpointManager(directory, read_only=True) as reader:
            loads[unchanged] = [reader.load(step) for step in range(1, 6)]
    assert {f"model.{k}" for k in base.state_dict()} <= _referenced(tmp_path / "True", 5)
    assert not any(path.startswith("head.") for path in _referenced(tmp_path / "True", 5))
    as_torch = lambda values: {k: torch.as_tensor(v) for k, v in values.items()}  # noqa: E731
    for referring, copying in zip(loads[True], loads[False], strict=True):
        assert _same(as_torch(referring["model"]), _values(base))
        assert _same(as_torch(referring["head"]), as_torch(copying["head"]))


def test_a_tensor_changed_behind_the_counter_at_every_step_is_hashed_ever_more_rarely(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fused optimizer writes its parameters and state without moving the version counter: each
    such tensor is found changed whenever it is hashed, so it is hashed again only after 1, 3, 7, ...
    saves that copy it unhashed (from its second miss in a row). Every step still holds its save point."""
    import crashsafe.state.unchanged as unchanged

    hashed: list[str] = []
    digest = unchanged._digest
    monkeypatch.setattr(unchanged, "_digest", lambda data, chunk: hashed.append("x") or digest(data, chunk))
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(ROWS, COLS))
    optim = torch.optim.AdamW([weight], fused=True)
    expected: dict[int, dict[str, torch.Tensor]] = {}
    with cs.CheckpointManager(tmp_path, keep_last=None) as manager:
        for step in range(1, 13):
            weight.grad = torch.randn_like(weight)
            optim.step()
            expected[step] = {"w": weight.detach().clone()}
            manager.save(step, {"model": {"w": weight}})
        manager.wait()
    assert weight._version == 0  # the fused step moved no counter: the hash is what saw the changes
    assert 0 < len(hashed) <= 4  # at saves 2, 3, 5 and 9: not at every one of 12
    for step, values in expected.items():
        with cs.CheckpointManager(tmp_path, read_only=True) as reader:
            loaded = {k: torch.as_tensor(v) for k, v in reader.load(step)["model"].items()}
        assert _same(loaded, values), step


def test_device_tensors_that_training_changes_are_fingerprinted_only_once(
    tmp_path: Path, fake_device: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fingerprint costs a pass over the tensor on its device: one whose version counter moves at
    every step (a trained parameter) is fingerprinted at its first save only; a frozen one until it
    is referred to."""
    import crashsafe.state.unchanged as unchanged

    printed: list[int] = []
    print_of = unchanged.print_of
    monkeypatch.setattr(unchanged, "print_of", lambda t: printed.append(t.data_ptr()) or print_of(t))
    torch.manual_seed(0)
    trained, frozen = fake_device(torch.randn(ROWS, COLS)), fake_device(torch.randn(ROWS, COLS))
    with cs.CheckpointManager(tmp_path, keep_last=None) as manager:
        for step in range(1, 7):
            with torch.no_grad():
                trained.add_(1.0)  # counted: its version moves
            manager.save(step, {"trained": trained, "frozen": frozen})
        manager.wait()
    assert printed.count(trained.data_ptr()) == 1
    assert _referenced(tmp_path, 6) == {"frozen"}
    with cs.CheckpointManager(tmp_path, read_only=True) as reader:
        assert torch.equal(torch.as_tensor(reader.load(6)["trained"]), trained)


def test_a_forked_child_fingerprints_while_a_parent_thread_held_the_lock() -> None:
    """The fingerprint keys' lock, held by another thread of the parent at the fork, is the child's
    anew (as crashsafe._cuda's is): the child's first fingerprint does not wait for it forever."""
    import os
    import threading

    import crashsafe.state.fingerprint as fingerprint

    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with fingerprint._LOCK:
            taken.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait(30)
    try:
        pid = os.fork()
        if pid == 0:  # the child takes the lock as fingerprinting does (no torch work: its thread pools
            os._exit(0 if fingerprint._LOCK.acquire(timeout=10) else 1)  # may not survive a fork)
        deadline = time.monotonic() + 30
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, "the child hung or failed"
    finally:
        release.set()
        holder.join()
