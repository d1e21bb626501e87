"""Lightning with crashsafe: the CheckpointIO plugin under the stock ModelCheckpoint, the Callback,
resume after real SIGKILLs (bit-identical), and what Lightning's own readers say."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
import os
import random
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from typer.testing import CliRunner

import crashsafe as cs
from crashsafe.cli.app import app
from crashsafe.integrations import lightning as cs_lightning
from crashsafe.integrations.pointer import MESSAGE, STORE, Pointer, write_pointer
from crashsafe.workloads import lightning_digits as job

from .conftest import kill_after_commits, run_to_end

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _fit(directory: Path, steps: int, checkpoint: ModelCheckpoint, ckpt_path: str | None = None) -> Any:
    module = job.DigitsModule(data_dir=directory, extra=argparse.Namespace(note="digits"))
    trainer = job.make_trainer(steps, [cs_lightning.CrashsafeCheckpointIO()], [checkpoint], directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, ckpt_path=ckpt_path)
    return module, trainer


def _stored_names(directory: Path) -> list[str]:
    with cs.CheckpointManager(directory / STORE, read_only=True) as mgr:
        return sorted(mgr.load(step)["name"] for step in mgr.steps())


def _ckpt_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.suffix == ".ckpt")


def test_top_k_last_and_every_n_steps_keep_one_step_per_file(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path, monitor="loss", mode="min", save_top_k=2, save_last=True, every_n_train_steps=3
    )
    module, _ = _fit(tmp_path, 18, checkpoint)
    kept = sorted(Path(p).name for p in checkpoint.best_k_models)
    assert len(kept) == 2
    assert _ckpt_files(tmp_path) == sorted([*kept, "last.ckpt"])
    assert _stored_names(tmp_path) == sorted([*kept, "last.ckpt"])  # dropped top-k and older lasts deleted
    last = cs_lightning.load_checkpoint(tmp_path / "last.ckpt")
    assert last["global_step"] == 18
    assert torch.equal(last["state_dict"]["net.5.weight"], module.state_dict()["net.5.weight"])
    for name in kept:
        step = cs_lightning.load_checkpoint(tmp_path / name)["global_step"]
        assert f"step={step}" in name
    assert cs.verify(tmp_path / STORE).ok


def test_save_last_link_and_resaving_one_path(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path, filename="latest", save_top_k=1, save_last="link", every_n_train_steps=4,
        enable_version_counter=False,
    )  # fmt: skip
    _fit(tmp_path, 12, checkpoint)
    assert (tmp_path / "last.ckpt").is_symlink()
    assert _ckpt_files(tmp_path) == ["last.ckpt", "latest.ckpt"]
    assert _stored_names(tmp_path) == ["latest.ckpt"]  # "latest" re-saved 3 times: one step left
    assert cs_lightning.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 12


def test_fit_resumes_from_last_and_from_a_path(tmp_path: Path) -> None:
    def checkpoint() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, save_last=True, every_n_train_steps=5)

    _, whole = _fit(tmp_path / "whole", 20, ModelCheckpoint(dirpath=tmp_path / "whole", save_top_k=0))
    _fit(tmp_path, 10, checkpoint())
    module, trainer = _fit(tmp_path, 20, checkpoint(), ckpt_path="last")
    reference, _ = _fit(tmp_path / "whole2", 20, ModelCheckpoint(dirpath=tmp_path / "whole2", save_top_k=0))
    assert trainer.global_step == 20
    assert job.state_digest(module, trainer) == job.state_digest(reference, whole)
    module, trainer = _fit(tmp_path, 20, checkpoint(), ckpt_path=str(tmp_path / "epoch=0-step=15.ckpt"))
    assert trainer.global_step == 20
    assert job.state_digest(module, trainer) == job.state_digest(reference, whole)


def test_lightning_readers_say_what_to_call(tmp_path: Path) -> None:
    _fit(tmp_path, 4, ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4))
    (path,) = tmp_path.glob("*.ckpt")
    for weights_only in (True, False):
        with pytest.raises(Exception, match="load it with crashsafe.integrations.lightning.load_checkpoint"):
            torch.load(path, weights_only=weights_only)
    with pytest.raises(Exception, match="crashsafe.integrations.lightning.load_from_checkpoint"):
        job.DigitsModule.load_from_checkpoint(path)
    assert MESSAGE in path.read_text()
    module = cs_lightning.load_from_checkpoint(job.DigitsModule, path)
    assert isinstance(module, job.DigitsModule)
    assert module.hparams["dtype"] is torch.float32  # hyperparameters of the kinds Lightning stores
    assert module.hparams["data_dir"] == tmp_path and isinstance(module.hparams["data_dir"], Path)
    assert module.hparams["schedule"] is job.Schedule.STEP
    assert module.hparams["extra"] == argparse.Namespace(note="digits")
    out = tmp_path / "model.safetensors"  # the weights, exported under the module's own names
    prefix = ["--prefix", "lightning.state_dict."]
    result = CliRunner().invoke(app, ["export", str(tmp_path / STORE), "-o", str(out), *prefix])
    assert result.exit_code == 0, result.output
    fresh = job.DigitsModule(seed=1)
    fresh.load_state_dict(load_file(out), strict=True)
    loaded = fresh.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in module.state_dict().items())


def test_fifos_where_checkpoints_go_never_hang_a_save_or_a_load(tmp_path: Path) -> None:
    """Hostile entries at Lightning's paths: FIFOs at ``last.ckpt`` and at its pointer's temporary
    name (opening one waits for a writer forever). The save replaces them, as Lightning's own
    writer replaces a file there; ``load_checkpoint`` refuses a FIFO by name."""
    fifos = [tmp_path / "last.ckpt", tmp_path / ".last.ckpt.crashsafe-tmp", tmp_path / "other.ckpt"]
    for fifo in fifos:
        os.mkfifo(fifo)
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path, save_last=True, every_n_train_steps=2, enable_version_counter=False
    )  # (with a version counter Lightning would save beside the FIFO, as last-v1.ckpt)
    fit = threading.Thread(target=_fit, args=(tmp_path, 4, checkpoint), daemon=True)
    fit.start()
    fit.join(timeout=120)
    if fit.is_alive():  # stuck opening a FIFO: a writer end lets it go on, and the test fails
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("a save waited on a FIFO")
    assert (tmp_path / "last.ckpt").is_file()
    assert cs_lightning.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 4
    with pytest.raises(cs.CrashsafeError, match="other.ckpt is not a checkpoint file"):
        cs_lightning.load_checkpoint(tmp_path / "other.ckpt")


def test_a_value_that_cannot_be_stored_is_refused_at_the_first_save_naming_its_path(tmp_path: Path) -> None:
    module = job.DigitsModule(data_dir=tmp_path, extra=argparse.Namespace(fn=object()))
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2)
    trainer = job.make_trainer(4, [cs_lightning.CrashsafeCheckpointIO()], [checkpoint], tmp_path)
    with pytest.raises(cs.UnsupportedStateError, match=r"lightning\.hyper_parameters\.extra\.fn"):
        trainer.fit(module)


def test_a_damaged_checkpoint_falls_back(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, save_last=True, every_n_train_steps=4)
    _fit(tmp_path, 8, checkpoint)
    with cs.CheckpointManager(tmp_path / STORE, read_only=True) as mgr:
        last = max(s for s in mgr.steps() if mgr.load(s)["name"] == "last.ckpt")
    data = tmp_path / STORE / f"step_{last:012d}" / "data.bin"
    with open(data, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)
    with pytest.warns(cs.CorruptCheckpointWarning):
        loaded = cs_lightning.load_checkpoint(tmp_path / "last.ckpt")
    assert loaded["global_step"] == 8  # epoch=0-step=8.ckpt holds the same step


@pytest.mark.parametrize("mode", ["plugin", "callback"])
def test_sigkilled_runs_resume_bit_identical(tmp_path: Path, mode: str) -> None:
    steps = ["--steps", "60", "--every", "3", "--mode", mode]
    run_to_end(job.main, [str(tmp_path / "whole"), *steps])
    killed = tmp_path / "killed"
    store = killed / STORE if mode == "plugin" else killed / "managed"
    kills = kill_after_commits(job.main, [str(killed), *steps], store, 3, random.Random(os.urandom(2)))
    assert kills == 3
    assert (killed / "final.txt").read_text() == (tmp_path / "whole" / "final.txt").read_text()
    assert cs.verify(store).ok


def test_removals_wait_for_an_idle_writer_and_a_re_saved_name_stays(tmp_path: Path) -> None:
    io = cs_lightning.CrashsafeCheckpointIO()
    for step, name in [(1, "a.ckpt"), (2, "b.ckpt"), (3, "a.ckpt")]:
        io.save_checkpoint({"global_step": step, "w": torch.full((4,), float(step))}, tmp_path / name)
    io.remove_checkpoint(tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "b.ckpt")
    io.save_checkpoint({"global_step": 4, "w": torch.full((4,), 4.0)}, tmp_path / "a.ckpt")
    io.teardown()
    assert _ckpt_files(tmp_path) == ["a.ckpt"]
    assert _stored_names(tmp_path) == ["a.ckpt"]  # b's and a's older steps deleted
    assert cs_lightning.load_checkpoint(tmp_path / "a.ckpt")["global_step"] == 4
    assert [s.name for s in io.stats] == ["a.ckpt", "b.ckpt", "a.ckpt", "a.ckpt"]
    first, *rest = io.stats  # a directory's first checkpoint commits before its save returns
    assert 0 < first.durable <= first.stall
    assert all(0 < s.stall < s.durable for s in rest)


def test_a_save_after_fit_leaves_the_directory_to_the_next_trainer(tmp_path: Path) -> None:
    """``trainer.save_checkpoint`` after ``fit`` reopened the plugin's store and kept its lock, so the
    next Trainer of the process (a notebook's next cell) got a LockedError naming its own pid."""
    _, trainer = _fit(tmp_path, 4, ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4))
    trainer.save_checkpoint(tmp_path / "after.ckpt")  # committed before it returns, and released
    assert cs_lightning.load_checkpoint(tmp_path / "after.ckpt")["global_step"] == 4
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_last=True)
    _, again = _fit(tmp_path, 8, checkpoint, ckpt_path=str(tmp_path / "after.ckpt"))
    assert again.global_step == 8
    assert cs_lightning.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 8
    trainer.save_checkpoint(tmp_path / "after.ckpt")  # the first Trainer again: its save goes through
    cs.CheckpointManager(tmp_path / STORE).close()  # and nothing holds the directory
    assert cs.verify(tmp_path / STORE).ok


def test_a_directory_held_by_a_running_trainer_says_so_to_another_in_the_process(tmp_path: Path) -> None:
    running, other = cs_lightning.CrashsafeCheckpointIO(), cs_lightning.CrashsafeCheckpointIO()
    running.save_checkpoint({"global_step": 1, "w": torch.ones(4)}, tmp_path / "a.ckpt")  # in its run
    holds = rf"in this very process \(pid {os.getpid()}\): the CrashsafeCheckpointIO plugin of a Lightning"
    with pytest.raises(cs.LockedError, match=holds + r".*trainer\.strategy\.checkpoint_io\.teardown\(\)"):
        other.save_checkpoint({"global_step": 2, "w": torch.ones(4)}, tmp_path / "b.ckpt")
    running.teardown()
    other.save_checkpoint({"global_step": 2, "w": torch.ones(4)}, tmp_path / "b.ckpt")
    other.teardown()
    assert _stored_names(tmp_path) == ["a.ckpt", "b.ckpt"]


def test_steps_are_lightnings_global_steps_and_ls_and_show_name_the_files(tmp_path: Path) -> None:
    """Each save is numbered by Lightning's global step; ``save_last``'s second save of a step takes
    the next number. ``crashsafe ls`` and ``show`` name the file each step was saved as."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, save_last=True, every_n_train_steps=3)
    _fit(tmp_path, 9, checkpoint)
    with cs.CheckpointManager(tmp_path / STORE, read_only=True) as mgr:
        saved = {step: (mgr.manifest(step).saved_as, mgr.load(step)["lightning"]["global_step"])
                 for step in mgr.steps()}  # fmt: skip
    assert saved == {
        3: ("epoch=0-step=3.ckpt", 3),
        6: ("epoch=0-step=6.ckpt", 6),
        9: ("epoch=0-step=9.ckpt", 9),
        10: ("last.ckpt", 9),  # (the older last.ckpt saves, steps 4 and 7, were replaced)
    }
    listed = CliRunner().invoke(app, ["ls", str(tmp_path / STORE)], env={"COLUMNS": "200"})
    assert listed.exit_code == 0, listed.output
    rows = [line.split() for line in listed.output.splitlines()]
    header = next(words for words in rows if "global_step" in words)
    assert header[:3] == ["step", "saved", "as"]
    rows_by_step = {words[0]: words for words in rows if words[:1] in (["3"], ["10"])}
    assert rows_by_step["10"][1] == "last.ckpt" and rows_by_step["10"][header.index("global_step") - 1] == "9"
    assert rows_by_step["3"][1] == "epoch=0-step=3.ckpt"
    shown = CliRunner().invoke(app, ["show", str(tmp_path / STORE), "--step", "10"], env={"COLUMNS": "200"})
    assert "step 10 of" in shown.output and "Lightning checkpoint file last.ckpt" in shown.output
    assert "global_step=9" in shown.output


def test_a_store_numbered_by_the_previous_scheme_still_resumes(tmp_path: Path) -> None:
    """Stores written before steps were global steps (numbered 0, 1, 2, ... in save order, with
    pointers that name no step) resume, and new saves go on above them."""
    def checkpoint() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, save_last=True, every_n_train_steps=5)

    _fit(tmp_path, 10, checkpoint())
    store = tmp_path / STORE
    with cs.CheckpointManager(store, read_only=True) as mgr:
        saved = [(mgr.load(step), mgr.manifest(step).metrics) for step in mgr.steps()]
    shutil.rmtree(store)
    with cs.CheckpointManager(store, keep_last=None, async_save=False) as mgr:
        for old_step, (state, metrics) in enumerate(saved):
            mgr.save(old_step, state, metrics)
    for name in _ckpt_files(tmp_path):  # and their pointers named no step
        write_pointer(tmp_path / name, Pointer(name))
    assert _stored_names(tmp_path) == ["epoch=0-step=10.ckpt", "epoch=0-step=5.ckpt", "last.ckpt"]
    assert cs_lightning.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 10
    module, trainer = _fit(tmp_path, 20, checkpoint(), ckpt_path="last")
    reference, whole = _fit(tmp_path / "whole", 20, ModelCheckpoint(dirpath=tmp_path / "whole", save_top_k=0))
    assert trainer.global_step == 20
    assert job.state_digest(module, trainer) == job.state_digest(reference, whole)
    with cs.CheckpointManager(store, read_only=True) as mgr:
        assert mgr.steps() == [0, 1, 15, 20, 21]  # the old numbers, then global steps
    for name, step in [("epoch=0-step=5.ckpt", 5), ("epoch=0-step=15.ckpt", 15), ("last.ckpt", 20)]:
        assert cs_lightning.load_checkpoint(tmp_path / name)["global_step"] == step


def test_the_callback_spells_out_the_managers_parameters() -> None:
    """``CrashsafeCallback(**options)`` hid the manager's parameters from IDEs and type checkers."""
    ours = inspect.signature(cs_lightning.CrashsafeCallback).parameters
    manager = inspect.signature(cs.CheckpointManager).parameters
    assert not [p for p in ours.values() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    # rank 0 saves alone; a memory tier needs every rank's part and restore (docs/memory.md)
    shared = set(manager) - {"read_only", "process_group", "coordination_timeout", "memory"}
    assert shared <= set(ours)
    assert all(ours[name].default is manager[name].default for name in shared - {"directory"})


def test_a_resume_is_told_through_lightnings_logger(tmp_path: Path) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    lightning_log = logging.getLogger("lightning.pytorch")
    lightning_log.addHandler(handler)
    try:
        callback = cs_lightning.CrashsafeCallback(tmp_path / "managed", every_n_steps=4)
        trainer = job.make_trainer(4, [], [callback], tmp_path)
        trainer.fit(job.DigitsModule(data_dir=tmp_path))
        callback = cs_lightning.CrashsafeCallback(tmp_path / "managed", every_n_steps=4)
        trainer = job.make_trainer(8, [], [callback], tmp_path)
        trainer.fit(job.DigitsModule(data_dir=tmp_path))
        checkpoint = ModelCheckpoint(dirpath=tmp_path / "io", every_n_train_steps=4, save_last=True)
        _fit(tmp_path / "io", 4, checkpoint)
        checkpoint = ModelCheckpoint(dirpath=tmp_path / "io", every_n_train_steps=4, save_last=True)
        _fit(tmp_path / "io", 8, checkpoint, "last")
    finally:
        lightning_log.removeHandler(handler)
    said = [r.getMessage() for r in records if r.getMessage().startswith("crashsafe:")]
    assert [text.split(" (")[0] for text in said] == [
        "crashsafe: resumed from step 4",  # the callback: the newest intact step
        "crashsafe: loaded step 5",  # the plugin: last.ckpt, saved right after epoch=0-step=4.ckpt
    ]
    assert said[0].startswith(f"crashsafe: resumed from step 4 ({tmp_path / 'managed'}, ")


def _save(io: cs_lightning.CrashsafeCheckpointIO, path: Path, global_step: int) -> None:
    io.save_checkpoint({"global_step": global_step, "w": torch.full((4,), float(global_step))}, path)


def _steps(directory: Path) -> list[int]:
    with cs.CheckpointManager(directory / STORE, read_only=True) as mgr:
        return mgr.steps()


def test_a_renamed_checkpoint_loads_its_own_step_and_keeps_it(tmp_path: Path) -> None:
    """``mv epoch=0-step=5.ckpt best.ckpt``: the next writer deleted step 5 (no pointer stood at
    the name saved inside it), and best.ckpt then loaded step 12, with only a warning that its save
    "did not commit". A pointer names its step: renamed, it loads that step, which stays."""
    io = cs_lightning.CrashsafeCheckpointIO()
    _save(io, tmp_path / "epoch=0-step=5.ckpt", 5)
    _save(io, tmp_path / "epoch=0-step=9.ckpt", 9)
    io.teardown()
    (tmp_path / "epoch=0-step=5.ckpt").rename(tmp_path / "best.ckpt")
    again = cs_lightning.CrashsafeCheckpointIO()
    _save(again, tmp_path / "epoch=0-step=12.ckpt", 12)
    again.teardown()
    assert _steps(tmp_path) == [5, 9, 12]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cs_lightning.load_checkpoint(tmp_path / "best.ckpt")["global_step"] == 5


def test_a_copy_in_the_folder_keeps_what_lightning_removes_or_saves_again(tmp_path: Path) -> None:
    """A pointer copied within the folder names its step: Lightning's removal of the original, or a
    new save of its name (``last.ckpt``), deletes the step only once no pointer file names it."""
    io = cs_lightning.CrashsafeCheckpointIO()
    _save(io, tmp_path / "epoch=0-step=3.ckpt", 3)
    _save(io, tmp_path / "last.ckpt", 3)  # step 4
    io.wait()
    shutil.copy(tmp_path / "epoch=0-step=3.ckpt", tmp_path / "best.ckpt")
    shutil.copy(tmp_path / "last.ckpt", tmp_path / "last-v1.ckpt")
    io.remove_checkpoint(tmp_path / "epoch=0-step=3.ckpt")
    _save(io, tmp_path / "last.ckpt", 6)
    _save(io, tmp_path / "epoch=0-step=9.ckpt", 9)
    _save(io, tmp_path / "last.ckpt", 9)  # step 10: step 6 is replaced and no pointer names it
    io.teardown()
    assert _ckpt_files(tmp_path) == ["best.ckpt", "epoch=0-step=9.ckpt", "last-v1.ckpt", "last.ckpt"]
    assert _steps(tmp_path) == [3, 4, 9, 10]
    loaded = {n: cs_lightning.load_checkpoint(tmp_path / n)["global_step"] for n in _ckpt_files(tmp_path)}
    assert loaded == {"best.ckpt": 3, "epoch=0-step=9.ckpt": 9, "last-v1.ckpt": 3, "last.ckpt": 9}
    for copy in ("best.ckpt", "last-v1.ckpt"):  # deleted by hand: steps Lightning let go, named no more
        (tmp_path / copy).unlink()
    again = cs_lightning.CrashsafeCheckpointIO()
    _save(again, tmp_path / "epoch=0-step=12.ckpt", 12)  # the next writer's open deletes them
    again.teardown()
    assert _steps(tmp_path) == [9, 10, 12]


def test_a_checkpoint_moved_out_of_the_folder_is_kept_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A pointer moved (or copied, then deleted) out of its folder names nothing there: its step
    was deleted at the next open, losing the checkpoint. It is kept and logged; the moved file
    says where it loads, and moved back it loads its step."""
    folder, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    elsewhere.mkdir()
    io = cs_lightning.CrashsafeCheckpointIO()
    _save(io, folder / "epoch=0-step=5.ckpt", 5)
    _save(io, folder / "epoch=0-step=9.ckpt", 9)
    io.teardown()
    shutil.move(folder / "epoch=0-step=5.ckpt", elsewhere / "best.ckpt")
    again = cs_lightning.CrashsafeCheckpointIO()
    with caplog.at_level(logging.WARNING, logger="crashsafe"):
        _save(again, folder / "epoch=0-step=12.ckpt", 12)
        again.teardown()
    assert _steps(folder) == [5, 9, 12]
    [said] = [r.getMessage() for r in caplog.records if "no pointer file" in r.getMessage()]
    assert "kept step 5 (saved as 'epoch=0-step=5.ckpt')" in said and "move it back" in said
    with pytest.raises(cs.NoCheckpointError, match=r"is not beside it: a pointer loads only in the folder"):
        cs_lightning.load_checkpoint(elsewhere / "best.ckpt")
    shutil.move(elsewhere / "best.ckpt", folder / "best.ckpt")
    assert cs_lightning.load_checkpoint(folder / "best.ckpt")["global_step"] == 5


def test_a_pointer_whose_step_is_gone_is_refused_not_answered_by_another_step(tmp_path: Path) -> None:
    """A pointer whose committed step was deleted loaded the newest step of the directory, warned
    only that its save "did not commit". It is a NoCheckpointError, also when the step's number
    now holds another checkpoint (the pointer's key tells them apart)."""
    io = cs_lightning.CrashsafeCheckpointIO()
    _save(io, tmp_path / "a.ckpt", 5)
    _save(io, tmp_path / "b.ckpt", 9)
    io.teardown()
    with cs.CheckpointManager(tmp_path / STORE) as mgr:
        mgr.delete([5])
    gone = r"a\.ckpt names step 5 .* committed but is gone: it was deleted"
    with pytest.raises(cs.NoCheckpointError, match=gone):
        cs_lightning.load_checkpoint(tmp_path / "a.ckpt")
    with cs.CheckpointManager(tmp_path / STORE) as mgr:
        mgr.delete([9])
    again = cs_lightning.CrashsafeCheckpointIO()
    _save(again, tmp_path / "c.ckpt", 5)  # numbered 5 again: a store with no step left
    again.teardown()
    assert cs_lightning.load_checkpoint(tmp_path / "c.ckpt")["global_step"] == 5
    replaced = r"step 5 there now is another checkpoint, saved as 'c\.ckpt'"
    with pytest.raises(cs.NoCheckpointError, match=replaced):
        cs_lightning.load_checkpoint(tmp_path / "a.ckpt")


def test_a_pointer_of_an_older_crashsafe_still_loads_and_keeps_its_steps(tmp_path: Path) -> None:
    """Pointers written before they named a step (the name only) load the newest step saved under
    that name, and a writer keeps every step saved under a name such a pointer holds."""
    io = cs_lightning.CrashsafeCheckpointIO()
    _save(io, tmp_path / "a.ckpt", 5)
    _save(io, tmp_path / "b.ckpt", 9)
    io.teardown()
    write_pointer(tmp_path / "best.ckpt", Pointer("a.ckpt"))  # as an older crashsafe wrote it
    (tmp_path / "a.ckpt").unlink()
    assert cs_lightning.load_checkpoint(tmp_path / "best.ckpt")["global_step"] == 5
    again = cs_lightning.CrashsafeCheckpointIO()
    _save(again, tmp_path / "c.ckpt", 12)
    again.teardown()
    assert _steps(tmp_path) == [5, 9, 12]


def test_the_folders_hostile_entries_are_never_followed_opened_or_tripped_on(tmp_path: Path) -> None:
    """Before deleting a step the plugin reads the pointer files of its folder: a FIFO there is never
    opened (no hang), a link never followed (one to a pointer outside the folder names nothing
    there, as that pointer cannot load it), and a directory where a removal mark goes breaks no
    removal. None of them is touched."""
    folder, outside = tmp_path / "ckpt", tmp_path / "outside"
    outside.mkdir()
    io = cs_lightning.CrashsafeCheckpointIO()
    _save(io, folder / "a.ckpt", 1)
    _save(io, folder / "b.ckpt", 2)
    io.teardown()
    shutil.copy(folder / "a.ckpt", outside / "a.ckpt")
    os.symlink(outside / "a.ckpt", folder / "link.ckpt")
    os.symlink("loop.ckpt", folder / "loop.ckpt")
    os.mkfifo(folder / "fifo.ckpt")
    (folder / ".b.ckpt.crashsafe-removed").mkdir()
    io = cs_lightning.CrashsafeCheckpointIO()

    def remove() -> None:
        io.remove_checkpoint(folder / "a.ckpt")  # with no run going: done at once
        io.remove_checkpoint(folder / "b.ckpt")

    removal = threading.Thread(target=remove, daemon=True)
    removal.start()
    removal.join(timeout=60)
    if removal.is_alive():
        with contextlib.suppress(OSError):
            os.close(os.open(folder / "fifo.ckpt", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("a removal waited on a FIFO")
    assert _steps(folder) == []
    assert sorted(p.name for p in folder.iterdir()) == [
        ".b.ckpt.crashsafe-removed", STORE, "fifo.ckpt", "link.ckpt", "loop.ckpt"
    ]
    assert (folder / ".b.ckpt.crashsafe-removed").is_dir() and (outside / "a.ckpt").is_file()
