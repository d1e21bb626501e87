"""Fine-tuning under Lightning (docs/integrations.md, "Fine-tuning: frozen weights are not saved
again"): with ``CrashsafeCallback`` a step refers to the frozen base an earlier step holds, owns only
the trainable part, and resumes bit for bit; a frozen weight changed behind torch's back is saved
anew. ``CrashsafeCheckpointIO`` copies every tensor, and its checkpoints load bit for bit."""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import crashsafe as cs
from crashsafe.integrations.lightning import CrashsafeCallback, CrashsafeCheckpointIO, load_checkpoint
from crashsafe.integrations.pointer import STORE
from crashsafe.state.unchanged import MIN_BYTES

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

WIDTH, BATCHES = 256, 10  # frozen weights of 256 KiB (watched: >= MIN_BYTES); batches per epoch
BASE = ("base.0.weight", "base.2.weight")
POKED = 12  # the global step after which a frozen weight is changed through .data


class _Frozen(LightningModule):
    """A frozen two-layer base and a small trainable head with dropout, on shuffled data."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU())
        self.base.requires_grad_(False)
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(WIDTH, 1))
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(8 * BATCHES, WIDTH, generator=generator)
        self.y = torch.randn(8 * BATCHES, 1, generator=generator)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.base(x)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.head.parameters(), lr=1e-2)

    def train_dataloader(self) -> Any:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=8, shuffle=True)


class _Poke(Callback):
    """After step ``POKED``, changes a frozen weight through ``.data`` (torch's version counter does
    not move) and records the state at every step."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer: Trainer, module: LightningModule, *args: Any) -> None:
        if trainer.global_step == POKED:
            module.base[0].weight.data.neg_()  # type: ignore[index]
        self.at[trainer.global_step] = {k: v.clone() for k, v in module.state_dict().items()}


def _fit(directory: Path, callbacks: list[Callback], plugins: list[Any], max_steps: int = -1) -> Any:
    """Train 3 epochs (or ``max_steps``); return the module."""
    torch.manual_seed(0)
    module = _Frozen()
    trainer = Trainer(
        max_epochs=3, max_steps=max_steps, callbacks=callbacks, plugins=plugins, default_root_dir=directory,
        logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        deterministic=True, enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    return module


def _digest(module: LightningModule) -> str:
    return hashlib.sha256(b"".join(t.numpy().tobytes() for t in module.state_dict().values())).hexdigest()


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _manifests(store: Path) -> dict[int, Any]:
    with cs.CheckpointManager(store, read_only=True) as mgr:
        return {step: mgr.manifest(step) for step in mgr.steps()}


def _refs(manifest: Any) -> dict[str, int]:
    prefix = "lightning.state_dict."
    return {p.path.removeprefix(prefix): p.ref for p in manifest.payloads if p.ref is not None}


def test_the_callback_refers_to_the_frozen_base_and_resumes_bit_identical(tmp_path: Path) -> None:
    poke = _Poke()
    store = tmp_path / "whole"
    whole = _fit(tmp_path, [CrashsafeCallback(store, every_n_steps=5, keep_last=None), poke], [])
    steps = _manifests(store)
    assert sorted(steps) == [5, 10, 15, 20, 25, 30]
    assert _refs(steps[5]) == {} and _refs(steps[10]) == dict.fromkeys(BASE, 5)
    # changed through .data after step 12: step 15 owns the new bytes, and later steps refer to them
    assert _refs(steps[15]) == {"base.2.weight": 5}
    assert all(_refs(steps[s]) == {"base.0.weight": 15, "base.2.weight": 5} for s in (20, 25, 30))
    assert all(whole.state_dict()[k].nbytes >= MIN_BYTES for k in BASE)  # big enough to be watched
    base = sum(whole.state_dict()[k].nbytes for k in BASE)
    trainable = sum(p.nbytes for p in whole.head.parameters())  # Adam: 2 more of it
    for step in (10, 20, 25, 30):  # owned: the head, its moments, small biases, RNG and loop state
        assert steps[step].referenced_nbytes == base
        assert 3 * trainable < steps[step].stored_nbytes < 3 * trainable + 32 * 1024 < base // 10
    with cs.CheckpointManager(store, read_only=True) as mgr:
        for step in steps:
            saved = mgr.load(step)["lightning"]["state_dict"]
            assert all(_bits(saved[k], v) for k, v in poke.at[step].items()), step
    assert cs.verify(store).ok

    resumed = tmp_path / "resumed"  # stopped at an epoch's end, then a fresh Trainer resumes
    _fit(tmp_path, [CrashsafeCallback(resumed, every_n_steps=5), _Poke()], [], max_steps=2 * BATCHES)
    later = _Poke()
    again = _fit(tmp_path, [CrashsafeCallback(resumed, every_n_steps=5), later], [])
    assert sorted(later.at) == list(range(2 * BATCHES + 1, 3 * BATCHES + 1))  # it trained only the rest
    assert _digest(again) == _digest(whole)

    off = tmp_path / "off"
    _fit(tmp_path, [CrashsafeCallback(off, every_n_steps=5, unchanged=False)], [], max_steps=10)
    assert all(not _refs(m) and m.stored_nbytes > base for m in _manifests(off).values())


def test_the_plugin_copies_a_frozen_base_at_every_save_and_loads_it_bit_identical(tmp_path: Path) -> None:
    """The plugin hands the manager its own staging copy, which each save writes anew (its version
    counter moves), so no step refers to another; every checkpoint loads as its save point was."""
    poke = _Poke()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=5)
    module = _fit(tmp_path, [poke, checkpoint], [CrashsafeCheckpointIO()], max_steps=20)
    steps = _manifests(tmp_path / STORE)
    assert len(steps) == 4
    base = sum(module.state_dict()[k].nbytes for k in BASE)
    assert all(not _refs(m) and m.stored_nbytes > base for m in steps.values())
    for path in sorted(tmp_path.glob("*.ckpt")):
        saved = load_checkpoint(path)
        at = poke.at[saved["global_step"]]
        assert all(_bits(saved["state_dict"][k], v) for k, v in at.items()), path.name
