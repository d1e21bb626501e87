"""A LeNet-5-style CNN sized for scikit-learn's 8x8 digits, SGD with momentum.

conv 3x3 (6) -> ReLU -> max-pool 2 -> conv 3x3 (16) -> ReLU -> max-pool 2 -> 120 -> 84 -> 10, the
LeNet-5 layout with kernels and padding shrunk for 8x8 inputs (28x28 MNIST does not ship offline).
"""

from __future__ import annotations

from typing import Any

from crashsafe.workloads.job import DigitsClassifier, digits_data

__all__ = ["LeNet", "make"]


class LeNet(DigitsClassifier):
    """LeNet-5-style CNN; cross-entropy; SGD(lr, momentum 0.9) on minibatches of ``batch``."""

    name = "lenet"

    def __init__(self, seed: int = 0, lr: float = 0.05, batch: int = 64) -> None:
        import torch
        from torch import nn

        self.seed, self.batch = seed, batch
        self.x, self.y = digits_data(images=True)
        torch.manual_seed(seed)
        self.model = nn.Sequential(
            nn.Conv2d(1, 6, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * 2 * 2, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, 10),
        )
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)


def make(seed: int = 0, **kwargs: Any) -> LeNet:
    return LeNet(seed, **kwargs)
