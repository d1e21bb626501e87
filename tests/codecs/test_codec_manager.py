"""Delta codecs inside the manager: real models and optimizers saved every step, restored through
chains and retention, after restarts, failures, corruption (real bytes flipped on disk) and
SIGKILLs."""

from __future__ import annotations

import os
import random
import shutil
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import crashsafe as cs
from crashsafe.codecs import LC, DeltaCodec, Incremental, Reference, Scar, TopN
from crashsafe.storage.layout import step_dir

from ..forks import Forked, Zygotes

HERE = Path(__file__).parent


def make_job(
    seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3)).to(dtype)
    if dtype != torch.float32:  # Adam's eps underflows in half precision
        return model, torch.optim.SGD(model.parameters(), lr=0.05)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(step)).to(next(model.parameters()).dtype)
    loss = model(x).float().pow(2).mean()
    optim.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    optim.step()


def as_numpy(t: torch.Tensor) -> np.ndarray[Any, Any]:
    t = t.detach().contiguous()
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


class Mirror:
    """The reconstruction the manager must store: the same codec on the same arrays, tracked here."""

    def __init__(self, codec: DeltaCodec) -> None:
        self.codec = codec
        self.refs: dict[str, Reference] = {}
        self.saves = 0

    def save(self, arrays: dict[str, np.ndarray[Any, Any]]) -> dict[str, np.ndarray[Any, Any]]:
        full = self.saves % self.codec.full_every == 0
        for name, array in arrays.items():
            _, self.refs[name] = self.codec.encode_delta(array, None if full else self.refs[name])
        self.saves += 1
        return {name: ref.array.copy() for name, ref in self.refs.items()}


CODECS = {"model.*": LC(bits=3, full_every=6), "*": Incremental(full_every=3)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_save", [True, False])
def test_every_step_through_chains_and_retention(tmp_path: Path, async_save: bool) -> None:
    model, optim = make_job()
    mirror = Mirror(CODECS["model.*"])  # type: ignore[arg-type]
    expected: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
    with cs.CheckpointManager(tmp_path, keep_last=3, codec=CODECS, async_save=async_save) as mgr:
        for step in range(23):
            train_step(model, optim, step)
            recon = mirror.save({f"model.{k}": as_numpy(v) for k, v in model.state_dict().items()})
            slots = optim.state_dict()["state"].items()
            optim_copy = {k: {n: v.clone() for n, v in s.items()} for k, s in slots}
            expected[step] = (recon, optim_copy)
            mgr.save(step, {"model": model, "optim": optim, "step": step, "ints": torch.arange(7) * step})
        mgr.wait()
        # last 3 = 20..22; their chains restart at save 18 (LC, full_every 6; 18 % 3 == 0 too)
        assert mgr.steps() == [18, 19, 20, 21, 22]
        for step in mgr.steps():
            manifest = mgr.manifest(step)
            for entry in manifest.payloads:
                if entry.path.startswith("model."):
                    assert entry.codec["id"] == "lc"
                    assert entry.base == (None if step % 6 == 0 else step - 1)
                elif entry.path.startswith("optim.state"):
                    assert entry.codec["id"] == "incremental"
                    assert entry.base == (None if step % 3 == 0 else step - 1)
                elif entry.path == "ints":
                    assert entry.codec["id"] == "incremental"  # lossless: LC never takes integers
            state = mgr.load(step)
            recon, optim_state = expected[step]
            for key, value in state["model"].items():
                assert as_numpy(value).tobytes() == recon[f"model.{key}"].tobytes(), (step, key)
            for pid, slots in optim_state.items():
                for name, value in slots.items():
                    assert torch.equal(state["optim"]["state"][pid][name], value), (step, pid, name)
            assert torch.equal(state["ints"], torch.arange(7) * step) and state["step"] == step
        live = model.state_dict()
        assert any(not torch.equal(state["model"][k], live[k]) for k in live), "LC is lossy"
        error = max(float((state["model"][k] - live[k]).abs().max()) for k in live)
        assert error < 0.05


@pytest.mark.timeout(60)
def test_a_restart_starts_new_chains_and_old_ones_still_restore(tmp_path: Path) -> None:
    model, optim = make_job()
    for step in range(4):
        train_step(model, optim, step)
        with cs.CheckpointManager(tmp_path, keep_last=10, codec=CODECS) as mgr:
            mgr.save(step, {"model": model, "optim": optim})
            mgr.save(step + 100, {"model": model, "optim": optim})
    bases = {
        s: {e.base for e in cs.CheckpointManager(tmp_path, read_only=True).manifest(s).payloads}
        for s in (0, 100, 3, 103)
    }
    assert bases[0] == {None} and bases[3] == {None}  # first save of each manager is full
    assert bases[100] == {0} and bases[103] == {3}
    reader = cs.CheckpointManager(tmp_path, read_only=True)
    assert set(reader.steps()) == {0, 1, 2, 3, 100, 101, 102, 103}
    for step in reader.steps():
        reader.load(step)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "codec", [LC(full_every=6), Incremental(full_every=6), Scar(0.1, 6), TopN(0.1, 6)], ids=str
)
def test_damage_in_a_base_falls_back_before_it_and_the_next_save_is_full(
    tmp_path: Path, codec: DeltaCodec
) -> None:
    model, optim = make_job()
    mirror = Mirror(codec)
    recons = {}
    mgr = cs.CheckpointManager(tmp_path, keep_last=None, codec={"model.*": codec, "*": Incremental(3)})
    for step in range(5):
        train_step(model, optim, step)
        recons[step] = mirror.save({f"model.{k}": as_numpy(v) for k, v in model.state_dict().items()})
        mgr.save(step, {"model": model, "optim": optim})
    mgr.wait()
    victim = mgr.manifest(2)
    entry = next(e for e in victim.payloads if e.path == "model.0.weight" and e.base == 1)
    with open(step_dir(tmp_path, 2) / entry.file, "r+b") as f:  # flip real bytes of its payload
        f.seek(entry.offset + entry.nbytes // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x5A]))
    with pytest.raises(cs.CorruptCheckpointError, match="fails its checksum"):
        mgr.load(4)  # step 4 is fine on disk, but its chain runs through step 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = mgr.load()
    assert len([w for w in caught if issubclass(w.category, cs.CorruptCheckpointWarning)]) == 3
    for key, value in state["model"].items():  # steps 4, 3, 2 skipped: step 1, exactly as encoded
        assert as_numpy(value).tobytes() == recons[1][f"model.{key}"].tobytes()
    train_step(model, optim, 5)
    mgr.save(5, {"model": model, "optim": optim})
    mgr.wait()
    assert all(e.base is None for e in mgr.manifest(5).payloads), "no delta against a damaged chain"
    mgr.load(5)
    mgr.close()


@pytest.mark.timeout(60)
def test_a_missing_base_is_named(tmp_path: Path) -> None:
    model, optim = make_job()
    with cs.CheckpointManager(tmp_path, keep_last=None, codec=CODECS) as mgr:
        for step in range(3):
            train_step(model, optim, step)
            mgr.save(step, {"model": model, "optim": optim})
    shutil.rmtree(step_dir(tmp_path, 1))  # deleted behind crashsafe's back
    reader = cs.CheckpointManager(tmp_path, read_only=True)
    with pytest.raises(cs.CorruptCheckpointError, match="base step 1 is missing"):
        reader.load(2)
    with pytest.warns(cs.CorruptCheckpointWarning):
        assert reader.load()["optim"]["state"][0]["step"] == 1  # step 0's state


@pytest.mark.timeout(60)
def test_a_base_saved_again_is_never_taken_for_the_one_a_delta_needs(tmp_path: Path) -> None:
    """Step 4 is a delta of step 3. Step 3 is damaged, so restore falls back to step 2, and the run
    trains on and saves step 3 again (the damaged one is replaced). Step 4 decoded against that new
    step 3, into wrong numbers, silently; now each manifest records the saves its deltas are
    against, and step 4 is damage: restore ends on the new step 3 and verify names step 4."""

    def state(value: float) -> dict[str, Any]:
        return {"w": np.full(1000, value, np.float32)}

    with cs.CheckpointManager(tmp_path, keep_last=None, codec=Incremental(), async_save=False) as mgr:
        for step in range(1, 5):
            mgr.save(step, state(step))
        assert [mgr.manifest(s).payloads[0].base for s in (2, 3, 4)] == [1, 2, 3]
    entry = cs.CheckpointManager(tmp_path, read_only=True).manifest(3).payloads[0]
    with open(step_dir(tmp_path, 3) / entry.file, "r+b") as f:  # flip a real byte of step 3
        f.seek(entry.offset + entry.nbytes // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x5A]))
    with cs.CheckpointManager(tmp_path, keep_last=None, codec=Incremental(), async_save=False) as mgr:
        live = state(0)
        with pytest.warns(cs.CorruptCheckpointWarning):
            assert mgr.restore(live) == 2
        with pytest.warns(cs.CorruptCheckpointWarning, match="step 3 was committed but damaged"):
            mgr.save(3, state(33))  # trained on from step 2
    reader = cs.CheckpointManager(tmp_path, read_only=True)
    with pytest.raises(cs.CorruptCheckpointError, match="step 3 was saved again after step 4"):
        reader.load(4)
    with pytest.warns(cs.CorruptCheckpointWarning, match="saved again"):
        assert reader.restore(live) == 3
    assert np.all(live["w"] == 33)
    report = cs.verify(tmp_path)
    assert report.intact == [1, 2, 3] and [d.step for d in report.damaged] == [4]


@pytest.mark.timeout(60)
def test_a_damaged_step_an_intact_step_needs_is_not_replaced(tmp_path: Path) -> None:
    """Step 3's raw payload is damaged, but step 4's deltas need only step 3's intact one. Saving
    step 3 again (after a restore of step 2) would leave step 4 unreadable: it is refused, and step 4
    still loads. It was replaced, turning the intact step 4 into damage."""
    codec = {"w": Incremental(), "*": "raw"}
    with cs.CheckpointManager(tmp_path, keep_last=None, codec=codec, async_save=False) as mgr:
        for step in range(1, 5):
            mgr.save(step, {"w": np.full(1000, step, np.float32), "x": np.full(10, step)})
        entry = next(p for p in mgr.manifest(3).payloads if p.path == "x")
    with open(step_dir(tmp_path, 3) / entry.file, "r+b") as f:
        f.seek(entry.offset)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x5A]))
    with cs.CheckpointManager(tmp_path, keep_last=None, codec=codec, async_save=False) as mgr:
        mgr.restore({"w": np.zeros(1000, np.float32), "x": np.zeros(10, np.int64)}, step=2)
        with pytest.raises(cs.CheckpointExistsError, match="a newer intact step needs it"):
            mgr.save(3, {"w": np.full(1000, 33, np.float32), "x": np.full(10, 33)})
        assert np.all(mgr.load(4)["w"] == 4)
    report = cs.verify(tmp_path)
    assert report.intact == [1, 2, 4] and [d.step for d in report.damaged] == [3]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("read", ["restore", "load"])
def test_a_fallback_past_damage_starts_new_chains(tmp_path: Path, read: str) -> None:
    """The same manager saved steps 0-2 as a chain; step 2 is damaged, and a read falls back past it
    with a warning only. The next save must not be a delta of step 2: it was, unreadable from the
    moment it committed (only a read that raised reset the chains)."""
    with cs.CheckpointManager(tmp_path, keep_last=None, codec=Incremental(), async_save=False) as mgr:
        for step in range(3):
            mgr.save(step, {"w": np.full(1000, step, np.float32)})
        entry = mgr.manifest(2).payloads[0]
        with open(step_dir(tmp_path, 2) / entry.file, "r+b") as f:
            f.seek(entry.offset + entry.nbytes // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x5A]))
        live = {"w": np.zeros(1000, np.float32)}
        with pytest.warns(cs.CorruptCheckpointWarning, match="Falling back"):
            assert (mgr.restore(live) if read == "restore" else mgr.load()["w"][0]) == 1
        mgr.save(3, {"w": np.full(1000, 3, np.float32)})
        assert mgr.manifest(3).payloads[0].base is None
        assert np.all(mgr.load(3)["w"] == 3)
    assert cs.verify(tmp_path).intact == [0, 1, 3]


@pytest.mark.timeout(60)
def test_a_failed_save_resets_the_chains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from crashsafe.storage.writer import StepWriter

    model, optim = make_job()
    real_commit = StepWriter.commit
    with cs.CheckpointManager(tmp_path, keep_last=None, codec=CODECS, async_save=False) as mgr:
        for step in range(2):
            train_step(model, optim, step)
            mgr.save(step, {"model": model, "optim": optim})

        def broken(self: StepWriter, manifest: Any) -> Path:
            raise cs.StorageError(5, "I/O error while committing (injected)")

        monkeypatch.setattr(StepWriter, "commit", broken)
        train_step(model, optim, 2)
        with pytest.raises(cs.StorageError):
            mgr.save(2, {"model": model, "optim": optim})
        monkeypatch.setattr(StepWriter, "commit", real_commit)
        mgr.save(3, {"model": model, "optim": optim})
        assert all(e.base is None for e in mgr.manifest(3).payloads)  # not a delta against step 2
        mgr.save(4, {"model": model, "optim": optim})
        assert {e.base for e in mgr.manifest(4).payloads if e.path.startswith("model")} == {3}
        for step in mgr.steps():
            mgr.load(step)


@pytest.mark.timeout(60)
def test_lossless_patterns_and_non_float_leaves_never_get_a_lossy_codec(tmp_path: Path) -> None:
    model, optim = make_job()
    train_step(model, optim, 0)
    flags = torch.ones(3, dtype=torch.bool)
    state = {"model": model, "counts": np.arange(5), "flags": flags, "rng": cs.RNGState()}
    with cs.CheckpointManager(tmp_path, codec={"*": LC()}, lossless=["model.2.*"]) as mgr:
        mgr.save(0, state)
        train_step(model, optim, 1)
        mgr.save(1, state)
        mgr.wait()
        codecs = {e.path: e.codec["id"] for e in mgr.manifest(1).payloads}
        loaded = mgr.load(1)
    assert codecs["model.0.weight"] == "lc"
    assert codecs["model.2.weight"] == "raw" and codecs["model.2.bias"] == "raw"
    assert codecs["counts"] == "raw" and codecs["flags"] == "raw"
    assert all(c == "raw" for p, c in codecs.items() if p.startswith("rng"))
    assert torch.equal(loaded["model"]["2.weight"], model.state_dict()["2.weight"])
    with pytest.raises(TypeError, match="glob patterns"):
        cs.CheckpointManager(tmp_path / "x", lossless="model.*")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("codec", [LC(bits=2), Scar(budget=0.1), TopN(budget=0.1)], ids=str)
def test_half_precision_models(tmp_path: Path, dtype: torch.dtype, codec: DeltaCodec) -> None:
    model, optim = make_job(dtype=dtype)
    with cs.CheckpointManager(tmp_path, codec={"model.*": codec, "*": "zstd"}) as mgr:
        for step in range(4):
            train_step(model, optim, step)
            mgr.save(step, {"model": model})
        loaded = mgr.load()["model"]
    for key, value in model.state_dict().items():
        assert loaded[key].dtype == dtype
        assert float((loaded[key].float() - value.float()).abs().max()) < 0.1


@pytest.mark.timeout(60)
def test_show_prints_codecs_bases_and_ratios(tmp_path: Path) -> None:
    from crashsafe.cli.app import app

    model = torch.nn.Linear(200, 100)
    with cs.CheckpointManager(tmp_path, codec={"*": LC()}) as mgr:
        for step in range(2):
            with torch.no_grad():
                model.weight.add_(torch.randn_like(model.weight) * 1e-3)
            mgr.save(step, {"model": model})
    result = CliRunner().invoke(app, ["show", str(tmp_path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if "model.weight" in line)
    assert "lc(bits=3" in row and "step 0" in row
    ratio = float(row.split()[-1].rstrip("x"))  # the last column (plain text when piped)
    assert ratio > 5


@pytest.mark.timeout(240)
def test_sigkills_while_saving_delta_chains_leave_every_committed_step_restorable(
    tmp_path: Path, zygotes: Zygotes
) -> None:
    """Six SIGKILLs of a training process saving LC and incremental delta chains, then a run to the
    end: every committed step restores. (Each process is forked with torch imported: forks.py.)"""
    rng = random.Random(99)
    total, directory = 60, tmp_path / "ckpt"
    argv, env = [str(HERE / "scripts" / "lc_train.py"), str(directory), str(total)], dict(os.environ)
    with open(tmp_path / "stderr.log", "w+") as log:
        for _ in range(6):
            child = Forked(zygotes, 0, argv, env, log.fileno())
            child.stdout.readline()  # running and saving
            time.sleep(rng.uniform(0.0, 0.4))
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=60)
            child.stdout.close()
        finish = Forked(zygotes, 0, argv, env, log.fileno())
        finish.communicate(timeout=120)
        assert finish.returncode == 0, log.seek(0) or log.read()[-3000:]
    report = cs.verify(directory)
    assert report.ok
    reader = cs.CheckpointManager(directory, read_only=True)
    assert reader.latest_step() == total - 1
    for step in reader.steps():
        assert reader.load(step)["step"] == step
