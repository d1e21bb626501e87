"""What the compression study trains: a deterministic job with a model, an optimizer and a loss.

Iteration ``i`` always trains on the same minibatch (a pure function of the job's seed and ``i``),
so a job restored from a checkpoint at iteration ``f`` and resumed from ``f + 1`` sees exactly the
data the original run saw. ``loss()`` is the full training loss, the quantity rework is measured
on. Each job module exposes ``make(seed) -> Job``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

__all__ = ["DigitsClassifier", "Job", "digits_data", "minibatch"]


class Job(ABC):
    """A model, its optimizer and its data."""

    name: str
    model: Any  # torch.nn.Module
    optimizer: Any  # torch.optim.Optimizer

    def state(self) -> dict[str, Any]:
        """What a checkpoint holds."""
        return {"model": self.model, "optim": self.optimizer}

    @abstractmethod
    def step(self, iteration: int) -> None:
        """One optimizer step on minibatch number ``iteration``."""

    @abstractmethod
    def loss(self) -> float:
        """The full training loss of the current parameters."""


class DigitsClassifier(Job):
    """A classifier of the digits data: cross-entropy on seeded minibatches of ``batch`` rows.

    Subclasses set ``model``, ``optimizer``, ``x``, ``y``, ``seed`` and ``batch`` in ``__init__``.
    """

    seed: int
    batch: int
    x: Any  # torch.Tensor
    y: Any  # torch.Tensor

    def step(self, iteration: int) -> None:
        import torch

        rows = minibatch(self.seed, iteration, self.batch, len(self.y))
        loss = torch.nn.functional.cross_entropy(self.model(self.x[rows]), self.y[rows])
        self.optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()

    def loss(self) -> float:
        import torch

        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(self.model(self.x), self.y))


def minibatch(seed: int, iteration: int, size: int, total: int) -> np.ndarray[Any, Any]:
    """Row indices of minibatch ``iteration``: epochs are seeded permutations of ``total`` rows."""
    per_epoch = max(1, total // size)
    epoch, index = divmod(iteration, per_epoch)
    order = np.random.default_rng((seed, epoch)).permutation(total)
    return order[index * size : (index + 1) * size]


def digits_data(images: bool) -> tuple[Any, Any]:
    """scikit-learn's bundled digits (1797 8x8 images, shipped with the package): (x, y) tensors.

    Pixels are scaled to [0, 1]; ``images`` gives shape (N, 1, 8, 8), else (N, 64).
    """
    import torch
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32)
    x = x[:, None] if images else x.reshape(len(x), -1)
    return x, torch.tensor(digits.target, dtype=torch.int64)
