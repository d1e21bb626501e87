"""A multilayer perceptron (64-256-256-10, ReLU) on scikit-learn's digits, SGD with momentum."""

from __future__ import annotations

from typing import Any

from crashsafe.workloads.job import DigitsClassifier, digits_data

__all__ = ["MLP", "make"]


class MLP(DigitsClassifier):
    """Two hidden layers of ``width``; cross-entropy; SGD(lr, momentum 0.9) on minibatches."""

    name = "mlp"

    def __init__(self, seed: int = 0, width: int = 256, lr: float = 0.05, batch: int = 64) -> None:
        import torch
        from torch import nn

        self.seed, self.batch = seed, batch
        self.x, self.y = digits_data(images=False)
        torch.manual_seed(seed)
        self.model = nn.Sequential(
            nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
        )
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)


def make(seed: int = 0, **kwargs: Any) -> MLP:
    return MLP(seed, **kwargs)
