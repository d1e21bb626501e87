"""Multinomial logistic regression on scikit-learn's digits, trained with plain minibatch SGD."""

from __future__ import annotations

from typing import Any

from crashsafe.workloads.job import Job, digits_data, minibatch

__all__ = ["LogReg", "make"]


class LogReg(Job):
    """64 pixels -> 10 classes, softmax cross-entropy, SGD(lr) on minibatches of ``batch``."""

    name = "logreg"

    def __init__(self, seed: int = 0, lr: float = 0.5, batch: int = 64) -> None:
        import torch

        self.seed, self.batch = seed, batch
        self.x, self.y = digits_data(images=False)
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(64, 10)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)

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


def make(seed: int = 0, **kwargs: Any) -> LogReg:
    return LogReg(seed, **kwargs)
