"""The digits CNN as a Lightning module, trained by a stock ``Trainer`` with crashsafe checkpoints.

Used by the integration tests (killed and resumed) and ``bench/integrations.py``. Each batch is a
pure function of ``(seed, epoch, batch_idx)``: Lightning restarts a plain dataloader at the start
of the epoch on resume (it resumes mid-epoch exactly only with a resumable loader), while
``batch_idx`` continues where the checkpoint left off. Dropout draws from torch's RNG, which the
crashsafe glue saves and restores, so a resumed run ends bit-identical to an uninterrupted one.

``python -m crashsafe.workloads.lightning_digits DIR --steps 60 --mode plugin|callback`` trains,
resuming from DIR if it holds a checkpoint, and writes the final weights' digest to DIR/final.txt.
"""

from __future__ import annotations

import argparse
import enum
import hashlib
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from crashsafe.workloads.digits import _load

__all__ = ["DigitsModule", "Schedule", "main", "make_trainer", "state_digest"]


class Schedule(enum.Enum):
    """How the learning rate decays (an enum hyperparameter, as real modules have)."""

    STEP = "step"


class DigitsModule(LightningModule):
    """A small CNN on scikit-learn's bundled digits; hyperparameters of the kinds people save."""

    def __init__(
        self,
        lr: float = 2e-3,
        width: int = 16,
        batch_size: int = 32,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        data_dir: Path = Path("."),
        schedule: Schedule = Schedule.STEP,
        extra: argparse.Namespace | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.net = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Dropout(0.25),
            nn.Linear(width * 16, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        ).to(dtype)
        x, y, _, _ = _load(seed)
        self.x, self.y = torch.from_numpy(x).to(dtype), torch.from_numpy(y)

    def batch(self, epoch: int, batch_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The minibatch ``batch_idx`` of ``epoch``: a pure function of the seed, epoch and index."""
        order = np.random.default_rng((self.hparams["seed"], epoch)).permutation(len(self.y))
        size = self.hparams["batch_size"]
        rows = torch.from_numpy(order[batch_idx * size : (batch_idx + 1) * size])
        return self.x[rows], self.y[rows]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = self.batch(self.current_epoch, batch_idx)
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optim = torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])
        sched = torch.optim.lr_scheduler.StepLR(optim, step_size=25, gamma=0.7)
        return {"optimizer": optim, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> Any:
        return list(range(len(self.y) // self.hparams["batch_size"]))  # placeholders: see batch()


def make_trainer(max_steps: int, plugins: list[Any], callbacks: list[Any], directory: Path) -> Trainer:
    """A quiet, deterministic CPU Trainer."""
    return Trainer(
        max_steps=max_steps,
        plugins=plugins,
        callbacks=callbacks,
        default_root_dir=directory,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
    )


def state_digest(module: LightningModule, trainer: Trainer) -> str:
    """sha256 of the weights and the optimizer state, bit for bit."""
    digest = hashlib.sha256()
    for tensor in module.state_dict().values():
        digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for state in trainer.optimizers[0].state.values():
        for value in state.values():
            digest.update(value.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    from crashsafe.integrations.lightning import CrashsafeCallback, CrashsafeCheckpointIO

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--mode", choices=["plugin", "callback"], default="plugin")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # Lightning's advice on workers, resumable loaders, ...
    module = DigitsModule(data_dir=args.directory, extra=argparse.Namespace(note="digits"))
    if args.mode == "plugin":
        checkpoint = ModelCheckpoint(dirpath=args.directory, every_n_train_steps=args.every, save_last=True)
        trainer = make_trainer(args.steps, [CrashsafeCheckpointIO()], [checkpoint], args.directory)
        trainer.fit(module, ckpt_path="last")
    else:
        callback = CrashsafeCallback(args.directory / "managed", every_n_steps=args.every, keep_last=2)
        trainer = make_trainer(args.steps, [], [callback], args.directory)
        trainer.fit(module)
    (args.directory / "final.txt").write_text(state_digest(module, trainer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
