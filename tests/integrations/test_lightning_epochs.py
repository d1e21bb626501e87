"""Which Lightning resumes are exact (docs/integrations.md, "Which resumes are exact").

A checkpoint taken mid-epoch (``every_n_train_steps`` that does not end an epoch) does not resume
exactly in Lightning itself, whatever writes the file: with a plain DataLoader, Lightning restarts
the epoch's data from its first batch while counting on from the saved batch index. crashsafe's
plugin resumes exactly where Lightning can: at an epoch's end, RNG included (Lightning's own files
hold no RNG state, so their resumed runs draw other dropout masks and another shuffle).
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from crashsafe.integrations.lightning import CrashsafeCheckpointIO

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

BATCHES = 10  # per epoch


class _Module(LightningModule):
    """A small regression on 80 fixed samples; dropout and shuffling optional."""

    def __init__(self, dropout: float, shuffle: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 1))
        generator = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(8 * BATCHES, 8, generator=generator), torch.randn(8 * BATCHES, 1)
        self.shuffle = shuffle

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> Any:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=8, shuffle=self.shuffle)


def _fit(
    directory: Path, crashsafe: bool, every: int, random: bool, max_steps: int = -1, resume: str | None = None
) -> str:
    """Train to 3 epochs (or ``max_steps``), checkpointing every ``every`` steps; return a digest of
    the weights."""
    torch.manual_seed(0)
    module = _Module(0.2 if random else 0.0, shuffle=random)
    trainer = Trainer(
        max_epochs=3, max_steps=max_steps, plugins=[CrashsafeCheckpointIO()] if crashsafe else [],
        callbacks=[ModelCheckpoint(dirpath=directory, save_top_k=-1, every_n_train_steps=every)],
        default_root_dir=directory, logger=False, enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu", deterministic=True,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, ckpt_path=None if resume is None else str(directory / resume))
    assert trainer.global_step == (3 * BATCHES if max_steps < 0 else max_steps)
    return hashlib.sha256(b"".join(t.numpy().tobytes() for t in module.state_dict().values())).hexdigest()


def _resumed(directory: Path, crashsafe: bool, every: int, stop: int, random: bool = False) -> str:
    """A run stopped at step ``stop``, then resumed from its checkpoint there to the end."""
    _fit(directory, crashsafe, every, random, max_steps=stop)
    return _fit(directory, crashsafe, every, random, resume=f"epoch={(stop - 1) // BATCHES}-step={stop}.ckpt")


def test_a_mid_epoch_checkpoint_resumes_as_lightnings_own_does_and_an_epoch_end_one_exactly(
    tmp_path: Path,
) -> None:
    whole = _fit(tmp_path / "whole", False, 5, random=False)
    # no randomness at all: any difference is where the data stood
    mid_lightning = _resumed(tmp_path / "mid-lightning", False, 5, stop=15)
    mid_crashsafe = _resumed(tmp_path / "mid-crashsafe", True, 5, stop=15)
    assert mid_lightning == mid_crashsafe != whole  # Lightning's caveat, with either writer
    assert _resumed(tmp_path / "end-lightning", False, BATCHES, stop=20) == whole
    assert _resumed(tmp_path / "end-crashsafe", True, BATCHES, stop=20) == whole
    # dropout and a shuffled loader: the RNG states crashsafe saves make the epoch-end resume exact
    whole = _fit(tmp_path / "whole-random", False, 5, random=True)
    assert _resumed(tmp_path / "end-crashsafe-random", True, BATCHES, stop=20, random=True) == whole
    assert _resumed(tmp_path / "end-lightning-random", False, BATCHES, stop=20, random=True) != whole
