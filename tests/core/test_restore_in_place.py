"""restore() reads payloads straight into the live tensors; a damaged payload found while it does so
never leaves the live state half old and half damaged (crashsafe/restoring.py).

The damage is real: one byte of a data file flipped, for every codec. The payload damaged is the
one restore reads last, and the tests check that other payloads were written into live memory
before the damage was found, so an implementation that does not restore the older step completely
would fail them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import crashsafe as cs
from crashsafe.chain import ChainReader
from crashsafe.codecs import LC, Incremental

from ..hostile import stop

CODECS: dict[str, Any] = {"raw": "raw", "zstd": "zstd", "incremental": Incremental(), "lc": LC()}


def _state(seed: int) -> dict[str, Any]:
    """A model, its optimizer after one step, a numpy array and (last) a small tensor."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(8, 16)).sum().backward()
    optim.step()
    rng = np.random.default_rng(seed)
    return {"model": model, "optim": optim, "table": rng.standard_normal(50), "last": torch.randn(3)}


def _arrays(state: dict[str, Any]) -> dict[str, np.ndarray[Any, Any]]:
    """Every array of a state by path, copied (to compare states)."""
    out = {f"model.{k}": v.detach().numpy().copy() for k, v in state["model"].state_dict().items()}
    for i, slots in state["optim"].state_dict()["state"].items():
        out |= {f"optim.state.{i}.{k}": v.detach().numpy().copy() for k, v in slots.items()}
    return out | {"table": state["table"].copy(), "last": state["last"].numpy().copy()}


def _saved(directory: Path, steps: int, codec: Any) -> list[dict[str, np.ndarray[Any, Any]]]:
    """Save ``steps`` states of different values; return what each step loads back as."""
    with cs.CheckpointManager(directory, codec=codec, keep_last=None, async_save=False) as mgr:
        for step in range(1, steps + 1):
            mgr.save(step, _state(step))
        loaded = []
        for step in range(1, steps + 1):
            live = _state(100)
            mgr.restore(live, step=step)
            loaded.append(_arrays(live))
    return loaded


def _flip(directory: Path, step: int, path: str) -> None:
    """Flip one byte in the middle of the stored payload ``path`` of ``step``."""
    step_dir = directory / f"step_{step:012d}"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    entry = next(p for p in manifest["payloads"] if p["path"] == path)
    with open(step_dir / entry["file"], "r+b") as f:
        f.seek(entry["offset"] + entry["nbytes"] // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x5A]))


def _same(a: dict[str, np.ndarray[Any, Any]], b: dict[str, np.ndarray[Any, Any]]) -> list[str]:
    """Paths whose arrays differ between two states (bit for bit)."""
    assert a.keys() == b.keys()
    return [k for k in a if a[k].tobytes() != b[k].tobytes()]


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The payloads restore decodes straight into live memory, in the order it starts them."""
    seen: list[str] = []
    decode = ChainReader.decode

    def recording(self: ChainReader, step: int, entry: Any, **kwargs: Any) -> Any:
        if kwargs.get("out") is not None:
            seen.append(f"{step}:{entry.path}")
        return decode(self, step, entry, **kwargs)

    monkeypatch.setattr(ChainReader, "decode", recording)
    return seen


@pytest.mark.parametrize("name", list(CODECS))
def test_damage_found_in_place_restores_the_older_step_completely(
    tmp_path: Path, name: str, writes: list[str]
) -> None:
    saved = _saved(tmp_path, 3, CODECS[name])
    _flip(tmp_path, 3, "last")
    live = _state(100)
    params = [p.data_ptr() for p in live["model"].parameters()]
    writes.clear()
    with cs.CheckpointManager(tmp_path, read_only=True) as mgr, pytest.warns(cs.CorruptCheckpointWarning):
        assert mgr.restore(live) == 2
    earlier = writes[: writes.index("3:last")]
    assert len(earlier) > 5, writes  # step 3 had changed live memory before its damage was found
    assert _same(_arrays(live), saved[1]) == []  # and every array holds step 2, none step 3
    assert [p.data_ptr() for p in live["model"].parameters()] == params  # in place, not replaced


@pytest.mark.parametrize("name", list(CODECS))
def test_a_damaged_step_with_nothing_to_fall_back_to_leaves_the_live_state_unchanged(
    tmp_path: Path, name: str
) -> None:
    _saved(tmp_path, 2, CODECS[name])
    _flip(tmp_path, 2, "last")
    live = _state(100)
    before = _arrays(live)
    with cs.CheckpointManager(tmp_path, read_only=True) as mgr, pytest.raises(cs.CorruptCheckpointError):
        mgr.restore(live, step=2)  # named: no fallback, so verified before anything is written
    assert _same(_arrays(live), before) == []


def test_the_only_step_damaged_leaves_the_live_state_unchanged(tmp_path: Path) -> None:
    _saved(tmp_path, 1, "raw")
    _flip(tmp_path, 1, "last")
    live = _state(100)
    before = _arrays(live)
    with (
        cs.CheckpointManager(tmp_path, read_only=True) as mgr,
        warnings.catch_warnings(),
        pytest.raises(cs.CorruptCheckpointError) as caught,
    ):
        warnings.simplefilter("ignore", cs.CorruptCheckpointWarning)
        mgr.restore(live)
    assert "partly overwritten" not in str(caught.value)
    assert _same(_arrays(live), before) == []


def test_when_every_step_is_damaged_after_writing_the_error_says_the_live_state_changed(
    tmp_path: Path,
) -> None:
    _saved(tmp_path, 2, "raw")
    _flip(tmp_path, 2, "last")
    _flip(tmp_path, 1, "last")
    live = _state(100)
    with (
        cs.CheckpointManager(tmp_path, read_only=True) as mgr,
        warnings.catch_warnings(),
        pytest.raises(cs.CorruptCheckpointError) as caught,
    ):
        warnings.simplefilter("ignore", cs.CorruptCheckpointWarning)
        mgr.restore(live)
    assert "every checkpoint" in str(caught.value)
    assert "partly overwritten" in str(caught.value) and "rebuild the live objects" in str(caught.value)


def test_a_fallback_step_that_does_not_fit_says_so(tmp_path: Path) -> None:
    """Step 2 (which added a key) is damaged after it changed the live state; step 1, intact, lacks
    that key, so it cannot be restored into it. The error said no intact step was left; it says the
    step restore fell back to does not fit."""
    with cs.CheckpointManager(tmp_path, keep_last=None, async_save=False) as mgr:
        mgr.save(1, {"w": torch.full((1000,), 1.0)})
        mgr.save(2, {"w": torch.full((1000,), 2.0), "ema": torch.full((1000,), 2.0)})
    _flip(tmp_path, 2, "ema")
    live = {"w": torch.zeros(1000), "ema": torch.zeros(1000)}
    with (
        cs.CheckpointManager(tmp_path, read_only=True) as mgr,
        warnings.catch_warnings(),
        pytest.raises(cs.UnsupportedStateError) as caught,
    ):
        warnings.simplefilter("ignore", cs.CorruptCheckpointWarning)
        mgr.restore(live)
    message = str(caught.value)
    assert "'ema' is not in the checkpoint" in message and "partly overwritten" in message
    assert "does not fit it" in message and "no intact step was left" not in message


def test_restore_reads_into_the_live_tensors_memory(tmp_path: Path, writes: list[str]) -> None:
    """Plain tensors, parameters, buffers, optimizer moments and numpy arrays are read into place;
    what cannot be (another dtype's live value, a subclass) is copied in as before."""
    saved = _saved(tmp_path, 1, "raw")
    live = _state(100)
    live["table"] = live["table"].astype(">f8")  # big-endian: the bytes cannot go straight in
    with cs.CheckpointManager(tmp_path, read_only=True) as mgr:
        writes.clear()
        mgr.restore(live)
    assert {w.split(":", 1)[1] for w in writes} == set(saved[0]) - {"table"}
    assert _same(_arrays(live), saved[0]) == ["table"]  # its bytes are big-endian now
    assert np.array_equal(live["table"], saved[0]["table"]) and live["table"].dtype == ">f8"


def test_restore_from_the_disk_switches_to_large_reads_and_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every mapped range looks slow (as from a cold cache), so the rest of each payload is read
    with preadv after its first chunk; the verify-first pass as well."""
    import crashsafe.storage.reader

    monkeypatch.setattr(crashsafe.storage.reader, "_CACHED_BYTES_PER_SECOND", float("inf"))
    monkeypatch.setattr(crashsafe.storage.reader, "_READ_CHUNK", 256)
    monkeypatch.setattr(crashsafe.storage.reader, "_CHECK_CHUNK", 256)
    saved = _saved(tmp_path, 2, "raw")
    for step in (None, 1):
        live = _state(100)
        with cs.CheckpointManager(tmp_path, read_only=True) as mgr:
            assert mgr.restore(live, step=step) == (step or 2)
        assert _same(_arrays(live), saved[(step or 2) - 1]) == []
    _flip(tmp_path, 2, "model.0.weight")  # damage beyond the first chunk is found on the disk path
    with cs.CheckpointManager(tmp_path, read_only=True) as mgr, pytest.raises(cs.CorruptCheckpointError):
        mgr.restore(_state(100), step=2)


def test_load_mmap_gives_read_only_views_of_the_files(tmp_path: Path) -> None:
    with cs.CheckpointManager(tmp_path, codec={"model.*": "zstd", "*": "raw"}) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    with cs.CheckpointManager(tmp_path, read_only=True) as mgr:
        mapped, copied = mgr.load(mmap=True), mgr.load(numpy=True)
        table = mapped["table"]
        assert not table.flags.writeable and not table.flags.owndata  # a view of the mapped file
        assert isinstance(table.base, memoryview) or table.base is not None
        with pytest.raises(ValueError, match="read-only"):
            table[0] = 1.0
        assert np.array_equal(table, copied["table"])
        weight = mapped["model"]["0.weight"]  # zstd: decoded, as load() does
        assert weight.flags.writeable and np.array_equal(weight, copied["model"]["0.weight"])
        _flip(tmp_path, 2, "table")
        with pytest.raises(cs.CorruptCheckpointError, match="checksum"):
            mgr.load(2, mmap=True)
        with pytest.warns(cs.CorruptCheckpointWarning):
            assert np.array_equal(mgr.load(mmap=True)["last"], _arrays(_state(1))["last"])


def test_load_mmap_of_an_object_store_says_what_to_do(tmp_path: Path) -> None:
    with cs.CheckpointManager(f"file://{tmp_path}") as mgr:
        mgr.save(1, {"w": np.ones(3)})
        with pytest.raises(cs.CrashsafeError, match="local checkpoint directory.*without mmap=True"):
            mgr.load(mmap=True)
        assert np.array_equal(mgr.load()["w"], np.ones(3))


# ----------------------------------------------------------------------------- steps deleted mid-read

MIXED: dict[str, Any] = {"w*": Incremental(full_every=3), "*": "raw"}  # b is read before the deltas


def _live() -> dict[str, Any]:
    """Live arrays for delta_writer.py's steps (restored in place), none holding a step's values."""
    return {**{f"w{i}": np.full(1024, -1.0) for i in range(16)}, "b": np.full(64, -1)}


def _one_step(live: dict[str, Any]) -> float | None:
    """The step every live array holds (-1: untouched), or None when they hold a mix of steps."""
    held = {float(live["b"][0]), *(float(live[f"w{i}"][0]) for i in range(16))}
    whole = (
        all(len(set(live[f"w{i}"].tolist())) == 1 for i in range(16)) and len(set(live["b"].tolist())) == 1
    )
    return held.pop() if len(held) == 1 and whole else None


@pytest.mark.parametrize("when", ["opening a delta base", "the first write into the live state"])
def test_steps_deleted_mid_restore_leave_the_live_state_whole_or_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """The writer deletes every step while the newest is restored, where its raw payload is
    already in live memory in the old code: restore wrote part of step 3 and returned None. Deleted
    before restore opened the delta bases, nothing is written; after, step 3 is read whole from
    its open files."""
    import crashsafe.chain

    writer = cs.CheckpointManager(tmp_path, keep_last=None, async_save=False, codec=MIXED)
    for step in (1, 2, 3):
        writer.save(
            step, {**{f"w{i}": np.full(1024, float(step)) for i in range(16)}, "b": np.full(64, step)}
        )
    doomed = [3, 2, 1]

    def delete() -> None:
        if doomed:
            writer.delete(doomed)
            doomed.clear()

    class Deleting(crashsafe.chain.StepReader):
        def __init__(self, store: Any, step: int) -> None:
            if step == 2 and when == "opening a delta base":
                delete()
            super().__init__(store, step)

    decode = ChainReader.decode

    def deleting(self: ChainReader, step: int, entry: Any, **kwargs: Any) -> Any:
        if kwargs.get("out") is not None and when == "the first write into the live state":
            delete()
        return decode(self, step, entry, **kwargs)

    monkeypatch.setattr(crashsafe.chain, "StepReader", Deleting)
    monkeypatch.setattr(ChainReader, "decode", deleting)
    live = _live()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # deletion is not damage
        restored = cs.CheckpointManager(tmp_path, read_only=True).restore(live)
    assert writer.steps() == [] and not doomed  # the writer really deleted them mid-restore
    if when == "opening a delta base":
        assert restored is None and _one_step(live) == -1
    else:
        assert restored == 3 and _one_step(live) == 3
    writer.close()


@pytest.mark.timeout(120)
def test_restores_racing_a_deleting_writer_end_whole_or_untouched(tmp_path: Path, spawn: Any) -> None:
    """A real writer process commits and deletes steps (keep_last=2) as fast as tmpfs lets it
    while this process restores into live tensors: each restore ends with every live array in one
    step, or raises NoCheckpointError saying the steps were deleted while read (never damage) with
    the live state untouched. The old code left a restore half written about once in 10 s."""
    shm = Path("/dev/shm")
    directory = Path(tempfile.mkdtemp(dir=shm if shm.is_dir() else tmp_path))
    writer = spawn("delta_writer.py", directory, "mixed")
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        reader = cs.CheckpointManager(directory, read_only=True)
        steps: set[float] = set()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a CorruptCheckpointWarning would be a false alarm
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                live = _live()
                try:
                    restored = reader.restore(live)
                except cs.NoCheckpointError as exc:
                    assert "deleted while it was read" in str(exc) and "damage" not in str(exc)
                    assert _one_step(live) == -1
                    continue
                assert restored is not None and _one_step(live) == restored, "a restore half applied"
                steps.add(restored)
        assert len(steps) > 20  # it really raced many of the writer's steps
    finally:
        stop(writer)
        shutil.rmtree(directory)


def test_restore_works_where_torch_is_not_installed(tmp_path: Path) -> None:
    """A restore of numpy arrays in a process without torch (numpy and JAX users): it waited for the
    CUDA devices of no tensors and failed on an ``AssertionError`` ("CUDA tensors imply torch is
    imported"), so every in-place restore without torch was a traceback. The test process has torch
    imported, so the child blocks it."""
    script = f"""
import sys
sys.modules["torch"] = None  # import torch fails, as where it is not installed
import numpy as np
import crashsafe as cs
with cs.CheckpointManager({str(tmp_path / "ckpt")!r}, async_save=False) as mgr:
    mgr.save(1, {{"w": np.arange(5.0), "n": 3}})
    live = {{"w": np.zeros(5), "n": 0}}
    assert mgr.restore(live) == 1
    assert live["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and live["n"] == 3, live
assert "torch" not in sys.modules or sys.modules["torch"] is None
print("restored")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "restored" in result.stdout, result.stderr[-2000:]
