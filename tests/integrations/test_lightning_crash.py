"""CrashsafeCheckpointIO against Lightning's own file logic after a crash: ``save_last="link"`` links
``last.ckpt`` to a file as soon as its save returns, ``ckpt_path="last"`` picks the newest-modified
"last" file, and ``OnExceptionCheckpoint`` removes its file after the IO's teardown."""

from __future__ import annotations

import logging
import multiprocessing
import runpy
import signal
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.plugins import TorchCheckpointIO

import crashsafe as cs
from crashsafe.integrations import lightning as cs_lightning
from crashsafe.integrations.pointer import REMOVED, STORE
from crashsafe.workloads import lightning_digits as job

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

SCRIPT = Path(__file__).parent / "scripts" / "lightning_link_run.py"
LET_GO = Path(__file__).parent / "scripts" / "lightning_let_go_kill.py"
Wide = runpy.run_path(str(SCRIPT))["Wide"]


def _run(directory: Path, kill_at: int, max_steps: int) -> int:
    return _run_script(SCRIPT, [str(directory), str(kill_at), str(max_steps)])


def _run_script(script: Path, args: list[Any]) -> int:
    """Run ``script`` in a process forked from the forkserver (conftest.py preloads Lightning there,
    so a run costs its training); its exit code."""
    process = multiprocessing.get_context("forkserver").Process(
        target=runpy.run_path, args=(str(script), {"ARGS": args}, "__main__")
    )
    process.start()
    process.join(120)
    assert process.exitcode is not None, "the run did not end in 120 s"
    return process.exitcode


def _newest_committed_step(store: Path) -> int:
    with cs.CheckpointManager(store, read_only=True) as mgr:
        step: int = mgr.load(max(mgr.steps()))["lightning"]["global_step"]
        return step


@pytest.mark.parametrize("kill_at", [1, 4])
def test_a_run_killed_right_after_a_linked_save_resumes_from_its_newest_committed_step(
    tmp_path: Path, kill_at: int
) -> None:
    """Lightning links last.ckpt to the file of a save that has returned but not committed; the
    process dies there. The resume must start from the newest committed step (the first save of a
    directory commits before returning, so a kill after it resumes from it), not from scratch."""
    assert _run(tmp_path, kill_at, 8) == 9
    store = tmp_path / "ckpt" / STORE
    committed = _newest_committed_step(store)
    assert 1 <= committed <= kill_at
    assert (tmp_path / "ckpt" / "last.ckpt").is_symlink()
    assert _run(tmp_path, -1, 8) == 0
    assert (tmp_path / "started.txt").read_text().split() == ["0", str(committed)]
    assert cs_lightning.load_checkpoint(tmp_path / "ckpt" / "epoch=7-step=8.ckpt")["global_step"] == 8
    assert cs.verify(store).ok


def test_save_last_link_into_a_new_directory_while_the_writer_is_busy(tmp_path: Path) -> None:
    """The first callback's save keeps the writer thread busy; the second one's save returns and
    Lightning symlinks last.ckpt into its directory, which must exist by then."""
    busy = ModelCheckpoint(dirpath=tmp_path / "a", save_top_k=-1, every_n_train_steps=1)
    linked = ModelCheckpoint(dirpath=tmp_path / "b", save_last="link", every_n_train_steps=2)
    trainer = job.make_trainer(4, [cs_lightning.CrashsafeCheckpointIO()], [busy, linked], tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Wide())
    assert (tmp_path / "b" / "last.ckpt").is_symlink()
    assert cs_lightning.load_checkpoint(tmp_path / "b" / "last.ckpt")["global_step"] == 4


class _Start(Callback):
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.step = trainer.global_step


def test_resume_from_last_picks_the_newest_saved_of_two_last_files_as_lightning_does(tmp_path: Path) -> None:
    """Two ModelCheckpoints each re-save their own last.ckpt (a every 2 steps: 10 last; b every 3: 9
    last). Lightning resumes from the newest-modified one, so a re-save must make its file new."""

    def fit(root: Path, io: Any, steps: int, ckpt_path: str | None) -> tuple[str, int]:
        callbacks = [
            ModelCheckpoint(dirpath=root / "a", save_last=True, save_top_k=0, every_n_train_steps=2),
            ModelCheckpoint(dirpath=root / "b", save_last=True, save_top_k=0, every_n_train_steps=3),
            start := _Start(),
        ]
        trainer = job.make_trainer(steps, [io], callbacks, root)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Wide(), ckpt_path=ckpt_path)  # no Path hyperparameter: torch.load refuses one
        return str(Path(trainer.ckpt_path or root).relative_to(root)), start.step

    picked = {}
    for io in (TorchCheckpointIO(), cs_lightning.CrashsafeCheckpointIO()):
        root = tmp_path / type(io).__name__
        fit(root, io, 10, None)
        picked[type(io).__name__] = fit(root, type(io)(), 12, "last")
    assert picked["TorchCheckpointIO"] == ("a/last.ckpt", 10)
    assert picked["CrashsafeCheckpointIO"] == picked["TorchCheckpointIO"]


def test_on_exception_checkpoint_after_teardown_leaves_no_lock_behind(tmp_path: Path) -> None:
    """OnExceptionCheckpoint removes its file in its teardown, after the IO's: a second Trainer on
    the same directory in the same process must then save and resume normally."""

    def fit(steps: int, ckpt_path: str | None) -> Trainer:
        callbacks = [
            ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1),
            OnExceptionCheckpoint(tmp_path),
        ]
        trainer = job.make_trainer(steps, [cs_lightning.CrashsafeCheckpointIO()], callbacks, tmp_path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(job.DigitsModule(data_dir=tmp_path), ckpt_path=ckpt_path)
        return trainer

    fit(5, None)
    assert fit(10, "last").global_step == 10
    assert cs_lightning.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 10
    assert not [t for t in threading.enumerate() if t.name.startswith("crashsafe-lightning")]


def test_a_removal_after_teardown_is_done_at_once_and_closes_the_store(tmp_path: Path) -> None:
    import torch

    io = cs_lightning.CrashsafeCheckpointIO()
    for step, name in [(1, "a.ckpt"), (2, "b.ckpt")]:
        io.save_checkpoint({"global_step": step, "w": torch.full((4,), float(step))}, tmp_path / name)
    io.teardown()
    io.remove_checkpoint(tmp_path / "a.ckpt")
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["b.ckpt"]
    with cs.CheckpointManager(tmp_path / STORE) as writer:  # no lock left behind
        assert [writer.load(s)["name"] for s in writer.steps()] == ["b.ckpt"]


def test_an_empty_file_beside_the_store_loads_the_newest_committed_checkpoint(tmp_path: Path) -> None:
    """A save writes a new name's pointer without fsync (it must only outlive the process until its
    step commits); a power loss can leave that file empty. It loads the newest committed step."""
    import torch

    io = cs_lightning.CrashsafeCheckpointIO()
    io.save_checkpoint({"global_step": 1, "w": torch.ones(4)}, tmp_path / "a.ckpt")
    io.teardown()
    (tmp_path / "b.ckpt").write_bytes(b"")
    with pytest.warns(cs.CrashsafeWarning, match="did not commit"):
        assert cs_lightning.load_checkpoint(tmp_path / "b.ckpt")["global_step"] == 1


@pytest.mark.parametrize("mode", ["removal", "first"])
def test_steps_let_go_before_a_kill_are_deleted_at_the_next_open_and_no_other(
    tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Killed after Lightning removed two checkpoints (their pointers replaced by removal marks, the
    first step's deletion under way), or after a directory's first commit and before its pointer:
    the next writer deletes those steps, saying so, and keeps the rest (a step no pointer names is
    deleted only when a mark says crashsafe let it go)."""
    import torch

    assert _run_script(LET_GO, [tmp_path, mode]) == -signal.SIGKILL
    marks = sorted(p.name for p in tmp_path.glob(f".*{REMOVED}"))
    with cs.CheckpointManager(tmp_path / STORE, read_only=True) as mgr:
        left = mgr.steps()
    if mode == "removal":
        assert (marks, left) == ([f".a.ckpt{REMOVED}", f".b.ckpt{REMOVED}"], [1, 3])
    else:
        assert (marks, left) == ([f".a.ckpt{REMOVED}"], [1])
        assert not (tmp_path / "a.ckpt").exists()
    io = cs_lightning.CrashsafeCheckpointIO()
    with caplog.at_level(logging.INFO, logger="crashsafe"):
        io.save_checkpoint({"global_step": 9, "w": torch.ones(4)}, tmp_path / "d.ckpt")
        io.teardown()
    with cs.CheckpointManager(tmp_path / STORE, read_only=True) as mgr:
        assert mgr.steps() == ([3, 9] if mode == "removal" else [9])
    said = [r.getMessage() for r in caplog.records]
    assert any(text.endswith("deleting step 1 (saved as 'a.ckpt'): its file was removed, or saved again, "
                             "and no pointer file names it") for text in said)  # fmt: skip
    assert not [text for text in said if "no pointer file in the folder names" in text]
    assert not list(tmp_path.glob(f".*{REMOVED}"))
