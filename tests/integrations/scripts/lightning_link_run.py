"""A Lightning run under CrashsafeCheckpointIO with ``save_last="link"`` that dies (``os._exit``, no
cleanup) right after the save of step ``kill_at`` returns, while its commit is still in flight.

Run by tests/integrations/test_lightning_crash.py in a forked process with ``ARGS = [directory,
kill_at, max_steps]`` (``kill_at`` -1: no kill); it resumes with ``ckpt_path="last"`` and appends the
global step training started at to ``directory/started.txt``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from crashsafe.integrations.lightning import CrashsafeCheckpointIO
from crashsafe.workloads.lightning_digits import make_trainer


class Wide(LightningModule):
    """A linear model carrying 16 MiB of state, so that a commit takes a while (tens of ms)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)
        self.register_buffer("ballast", torch.randn(4_000_000))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss: torch.Tensor = ((self.lin(x) - y) ** 2).mean()
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)  # a step per epoch


class KillAfterSave(ModelCheckpoint):
    """ModelCheckpoint that ends the process right after its save (and link) at step ``kill_at``."""

    def __init__(self, kill_at: int, **options: Any) -> None:
        super().__init__(**options)
        self.kill_at = kill_at

    def on_train_batch_end(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, *args, **kwargs)
        if trainer.global_step == self.kill_at:
            os._exit(9)


class Started(Callback):
    def __init__(self, record: Path) -> None:
        self.record = record

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        with open(self.record, "a") as f:
            f.write(f"{trainer.global_step}\n")


def main(directory: Path, kill_at: int, max_steps: int) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    checkpoint = KillAfterSave(
        kill_at, dirpath=directory / "ckpt", save_last="link", save_top_k=-1, every_n_train_steps=1
    )
    callbacks = [Started(directory / "started.txt"), checkpoint]
    trainer = make_trainer(max_steps, [CrashsafeCheckpointIO()], callbacks, directory)
    trainer.fit(Wide(), ckpt_path="last")


if __name__ == "__main__":
    directory, kill_at, max_steps = globals()["ARGS"]  # given by the test (runpy.run_path)
    main(Path(directory), int(kill_at), int(max_steps))
