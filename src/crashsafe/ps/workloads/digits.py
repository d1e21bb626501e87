"""A dense model: a one-hidden-layer MLP on scikit-learn's bundled digits (1797 8x8 images).

Every minibatch touches every row, so every worker pulls the whole model every clock: the case
where FreeLauncher's pulled copies already give N+1 copies and replication costs nothing.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from crashsafe.ps.layout import TableSpec
from crashsafe.ps.workloads.base import F32, Ints, Workload

__all__ = ["DigitsMLP"]

_TRAIN = 1500


class DigitsMLP(Workload):
    """64 -> ``hidden`` (ReLU) -> 10 softmax; tables ``W1``, ``b1``, ``W2``, ``b2``."""

    defaults: ClassVar[dict[str, float]] = {"hidden": 64, "block_rows": 16}

    def __init__(self, seed: int, options: dict[str, Any] | None = None) -> None:
        super().__init__(seed, options)
        self.x: F32 = np.zeros((0, 64), np.float32)
        self.y: Ints = np.zeros(0, np.int64)

    def tables(self) -> list[TableSpec]:
        h, b = int(self.opt["hidden"]), int(self.opt["block_rows"])
        return [
            TableSpec("W1", 64, h, b),
            TableSpec("b1", 1, h, 1),
            TableSpec("W2", h, 10, b),
            TableSpec("b2", 1, 10, 1),
        ]

    def init_params(self) -> list[F32]:
        rng = self.rng(0x1417)
        h = int(self.opt["hidden"])
        return [
            (rng.normal(0.0, 1.0, (64, h)) * np.sqrt(2.0 / 64)).astype(np.float32),
            np.zeros((1, h), np.float32),
            (rng.normal(0.0, 1.0, (h, 10)) * np.sqrt(2.0 / h)).astype(np.float32),
            np.zeros((1, 10), np.float32),
        ]

    def _split(self) -> tuple[F32, Ints, F32, Ints]:
        from sklearn.datasets import load_digits

        data = load_digits()
        order = self.rng(0xDA7A).permutation(len(data.target))
        x = (data.data[order] / 16.0).astype(np.float32)
        y = data.target[order].astype(np.int64)
        return x[:_TRAIN], y[:_TRAIN], x[_TRAIN:], y[_TRAIN:]

    def load(self, worker: int, workers: int) -> None:
        x, y, _, _ = self._split()
        self.x, self.y = x[worker::workers], y[worker::workers]

    def batch(self, worker: int, clock: int, size: int) -> Any:
        pick = self.rng(worker, clock).integers(0, len(self.y), size)
        return self.x[pick], self.y[pick]

    def rows(self, batch: Any) -> list[Ints]:
        return [np.arange(t.rows, dtype=np.int64) for t in self.tables()]

    def _forward(self, x: F32, params: list[F32]) -> tuple[F32, F32]:
        w1, b1, w2, b2 = params
        hidden = np.maximum(x @ w1 + b1, np.float32(0.0))
        return hidden, hidden @ w2 + b2

    def grad(self, batch: Any, params: list[F32]) -> tuple[list[F32], float]:
        x, y = batch
        hidden, logits = self._forward(x, params)
        shifted = logits - logits.max(axis=1, keepdims=True)
        prob = np.exp(shifted)
        prob /= prob.sum(axis=1, keepdims=True)
        loss = float(-np.mean(np.log(prob[np.arange(len(y)), y] + 1e-12)))
        dlogits = prob
        dlogits[np.arange(len(y)), y] -= 1.0
        dlogits /= np.float32(len(y))
        dhidden = (dlogits @ params[2].T) * (hidden > 0)
        grads = [
            x.T @ dhidden,
            dhidden.sum(axis=0, keepdims=True),
            hidden.T @ dlogits,
            dlogits.sum(axis=0, keepdims=True),
        ]
        return [g.astype(np.float32) for g in grads], loss

    def evaluate(self, params: list[F32]) -> dict[str, float]:
        _, _, x, y = self._split()
        _, logits = self._forward(x, params)
        return {"accuracy": float(np.mean(logits.argmax(axis=1) == y))}
