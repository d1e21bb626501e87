"""A small CNN trained on scikit-learn's bundled digits (1797 8x8 images, no download).

Deterministic by construction: the minibatch of step ``s`` is a pure function of ``(seed, s)``, and
dropout draws from torch's RNG, which the state saves through :class:`crashsafe.RNGState`. So a run
resumed from a checkpoint continues bit-identically (with ``torch.set_num_threads(1)``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["DigitsTrainer", "main"]


def _load(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    train, test = order[:1500], order[1500:]
    return x[train], y[train], x[test], y[test]


class DigitsTrainer:
    """Model, optimizer, LR schedule, RNG and step of the digits CNN, as one checkpointable state."""

    def __init__(self, seed: int = 0, batch_size: int = 64, lr: float = 2e-3, width: int = 16) -> None:
        import torch
        from torch import nn

        from crashsafe.state.rng import RNGState

        self.seed = seed
        self.batch_size = batch_size
        self.x, self.y, self.x_test, self.y_test = _load(seed)
        torch.manual_seed(seed)
        self.model = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Dropout(0.25),
            nn.Linear(2 * width * 16, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )
        self.optim = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.sched = torch.optim.lr_scheduler.StepLR(self.optim, step_size=200, gamma=0.5)
        self.state: dict[str, Any] = {
            "model": self.model,
            "optim": self.optim,
            "sched": self.sched,
            "rng": RNGState(),
            "step": 0,
        }

    @property
    def step(self) -> int:
        return int(self.state["step"])

    def batch(self, step: int) -> tuple[Any, Any]:
        """The minibatch of ``step``: a pure function of (seed, step)."""
        import torch

        per_epoch = len(self.y) // self.batch_size
        epoch, index = divmod(step, per_epoch)
        order = np.random.default_rng((self.seed, epoch)).permutation(len(self.y))
        rows = order[index * self.batch_size : (index + 1) * self.batch_size]
        return torch.from_numpy(self.x[rows]), torch.from_numpy(self.y[rows])

    def train_step(self) -> float:
        """One optimizer step on the next minibatch; returns its loss."""
        import torch.nn.functional as F

        xb, yb = self.batch(self.step)
        self.model.train()
        self.optim.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(xb), yb)
        loss.backward()  # type: ignore[no-untyped-call]
        self.optim.step()
        self.sched.step()
        self.state["step"] = self.step + 1
        return float(loss.detach())

    def accuracy(self) -> float:
        """Held-out accuracy (300 test images)."""
        import torch

        self.model.eval()
        with torch.no_grad():
            pred = self.model(torch.from_numpy(self.x_test)).argmax(1).numpy()
        return float((pred == self.y_test).mean())


def main(argv: list[str] | None = None) -> None:
    """Train with checkpoints, resuming from the newest one; log events as JSON lines.

    Used by ``crashsafe demo`` as the process it kills: ``python -m crashsafe.workloads.digits
    --dir D --steps N --every K --log events.jsonl``.
    """
    spawned = time.time()
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--codec", default="raw")
    parser.add_argument("--log", type=Path, required=True)
    args = parser.parse_args(argv)

    from crashsafe.manager import CheckpointManager
    from crashsafe.workloads.supervised import deterministic_torch, train_logged

    deterministic_torch()
    trainer = DigitsTrainer(seed=args.seed)
    codec = {"model.*": args.codec, "*": "raw"}
    with CheckpointManager(args.dir, keep_last=3, codec=codec, save_on_sigterm=True) as mgr:
        train_logged(
            trainer,
            mgr,
            args.log,
            args.steps,
            spawned=spawned,
            save_every=args.every,
            done=lambda: {"accuracy": trainer.accuracy()},
        )


if __name__ == "__main__":
    main(sys.argv[1:])
