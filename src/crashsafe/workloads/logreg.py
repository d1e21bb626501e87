"""Multinomial logistic regression on scikit-learn's digits, trained with plain minibatch SGD."""

from __future__ import annotations

from typing import Any

from crashsafe.workloads.job import DigitsClassifier, digits_data

__all__ = ["LogReg", "make"]


class LogReg(DigitsClassifier):
    """64 pixels -> 10 classes, softmax cross-entropy, SGD(lr) on minibatches of ``batch``."""

    name = "logreg"

    def __init__(self, seed: int = 0, lr: float = 0.5, batch: int = 64) -> None:
        import torch

        self.seed, self.batch = seed, batch
        self.x, self.y = digits_data(images=False)
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(64, 10)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)


def make(seed: int = 0, **kwargs: Any) -> LogReg:
    return LogReg(seed, **kwargs)
