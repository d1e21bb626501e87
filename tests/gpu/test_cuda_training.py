"""CUDA training end to end: a job SIGKILLed three times and resumed ends bit-identical to an
uninterrupted one; Lightning (``accelerator="gpu"``) and Hugging Face's Trainer on CUDA resume
exactly; the CLI reads checkpoints of CUDA tensors. Skipped without a CUDA device."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import crashsafe as cs

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA device (CI has none): run `bash tests/gpu/run.sh` on a GPU machine; "
        "tests/core/test_device_staging.py checks the same ordering on the CPU",
    ),
]

SCRIPT = Path(__file__).parent / "scripts" / "cuda_train.py"
SRC = Path(__file__).resolve().parents[2] / "src"


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def _train(directory: Path, steps: int) -> subprocess.Popen[str]:
    command = [sys.executable, str(SCRIPT), str(directory), "--steps", str(steps), "--every", "10"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


@pytest.mark.timeout(600)
def test_a_cuda_job_sigkilled_three_times_resumes_bit_identical(tmp_path: Path) -> None:
    steps = 400
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    clean.mkdir(), killed.mkdir()
    reference = _train(clean, steps)
    rng = random.Random(5)
    resumed_from = []
    for _ in range(3):
        proc = _train(killed, steps)
        assert proc.stdout is not None
        resumed_from.append(proc.stdout.readline().split()[1])
        wanted = rng.randrange(2, 12)  # saves to see before the kill
        seen = 0
        for line in proc.stdout:
            seen += line.startswith("saved")
            if seen >= wanted:
                time.sleep(rng.uniform(0, 0.02))  # mid-save, or between saves
                break
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    last = _train(killed, steps)
    out, err = last.communicate(timeout=300)
    assert last.returncode == 0, err
    _, err = reference.communicate(timeout=300)
    assert reference.returncode == 0, err
    assert resumed_from[0] == "None" and "start None" not in out  # every restart resumed
    assert all(r != "None" for r in resumed_from[1:]), resumed_from
    assert (killed / "final.txt").read_text() == (clean / "final.txt").read_text()


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for tensor in tensors:
        h.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.timeout(300)
def test_lightning_on_the_gpu_resumes_exactly(tmp_path: Path) -> None:
    """A run stopped at step 30 of 70 (mid-epoch, checkpoints every 5 steps) and resumed by a new
    Trainer ends bit-identical to one that ran through, on the GPU."""
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from crashsafe.integrations.lightning import CrashsafeCheckpointIO
    from crashsafe.workloads.lightning_digits import DigitsModule

    class CudaDigits(DigitsModule):
        def batch(self, epoch: int, batch_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = super().batch(epoch, batch_idx)
            return x.to(self.device), y.to(self.device)

    class StopAt(Callback):
        """Ends training after ``step``, as a crash would (max_steps stays the same)."""

        def __init__(self, step: int) -> None:
            self.step = step

        def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
            trainer.should_stop = trainer.global_step >= self.step

    def fit(directory: Path, stop: int | None = None) -> str:
        module = CudaDigits(data_dir=tmp_path)
        callbacks: list[Any] = [ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=5)]
        trainer = Trainer(
            max_steps=70,
            accelerator="gpu",
            devices=1,
            plugins=[CrashsafeCheckpointIO()],
            callbacks=callbacks if stop is None else [*callbacks, StopAt(stop)],
            default_root_dir=directory,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            deterministic=True,
        )
        trainer.fit(module, ckpt_path="last")
        assert trainer.strategy.root_device.type == "cuda"  # trained there (fit moves it back at its end)
        moments = [v for s in trainer.optimizers[0].state.values() for v in s.values() if torch.is_tensor(v)]
        return _digest([*module.state_dict().values(), *moments])

    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = fit(tmp_path / "whole")
        fit(tmp_path / "split", stop=30)
        resumed = fit(tmp_path / "split")
    assert resumed == whole


@pytest.mark.timeout(300)
def test_hugging_face_trainer_on_cuda_resumes_exactly(tmp_path: Path) -> None:
    from transformers import TrainerCallback
    from transformers.utils import logging

    from crashsafe.integrations.transformers import CrashsafeTrainer
    from crashsafe.workloads.hf_tiny import TokenData, tiny_gpt2, training_args

    logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)

    class StopAt(TrainerCallback):
        """Ends training after ``step``, as a crash would (the schedule still aims at max_steps)."""

        def __init__(self, step: int) -> None:
            self.step = step

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            control.should_training_stop = state.global_step >= self.step
            return control

    def train(directory: Path, stop: int | None = None) -> Any:
        args = training_args(directory, 20, 5, use_cpu=False)
        callbacks = [] if stop is None else [StopAt(stop)]
        trainer = CrashsafeTrainer(
            model=tiny_gpt2(), args=args, train_dataset=TokenData(), callbacks=callbacks
        )
        trainer.train(resume_from_checkpoint=True)
        trainer.close()
        return trainer

    try:
        whole = train(tmp_path / "whole")
        train(tmp_path / "split", stop=10)
        split = train(tmp_path / "split")
    finally:
        torch.use_deterministic_algorithms(False)
    assert next(split.model.parameters()).is_cuda

    def digest(trainer: Any) -> str:
        moments = [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return _digest([*trainer.model.state_dict().values(), *moments])

    assert digest(split) == digest(whole)


def test_the_cli_reads_checkpoints_of_cuda_tensors(tmp_path: Path) -> None:
    weights = torch.randn(256, 256, device="cuda")
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": weights, "b": torch.zeros(3, device="cuda", dtype=torch.bfloat16)})
        weights.add_(1.0)
        mgr.save(2, {"w": weights, "b": torch.ones(3, device="cuda", dtype=torch.bfloat16)})
    cli = [sys.executable, "-m", "crashsafe"]
    for args, code in (
        (["verify", str(tmp_path)], 0),
        (["ls", str(tmp_path)], 0),
        (["show", str(tmp_path)], 0),
        (["diff", str(tmp_path), "1", "2"], 1),  # exit 1: they differ
    ):
        done = subprocess.run([*cli, *args], capture_output=True, text=True, env=_env(), timeout=120)
        assert done.returncode == code, (args, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr
    assert "w" in done.stdout and "b" in done.stdout
