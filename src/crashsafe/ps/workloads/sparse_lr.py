"""Sparse logistic regression on hashed features with Zipfian frequencies (generated data).

Each example has ``nnz`` raw feature ids drawn from a Zipf(``zipf``) law over ``vocab`` ids plus
a bias feature; ids are hashed into ``buckets`` (a power of two) by Fibonacci hashing. Labels
come from a hidden weight per bucket. Popular buckets are touched by every worker every clock,
the long tail rarely: exactly the keys FreeLauncher must replicate selectively.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from crashsafe.ps.layout import TableSpec
from crashsafe.ps.workloads.base import F32, Ints, Workload, rows_and_sum, zipf_ranks

__all__ = ["SparseLR"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def hash_features(ids: Ints, buckets: int) -> Ints:
    """Fibonacci hashing of raw feature ids into ``buckets`` (a power of two)."""
    shift = np.uint64(64 - int(buckets).bit_length() + 1)
    with np.errstate(over="ignore"):
        return ((ids.astype(np.uint64) * _GOLDEN) >> shift).astype(np.int64)


class SparseLR(Workload):
    """Binary logistic regression; one table ``w`` of ``buckets`` scalar weights."""

    defaults: ClassVar[dict[str, float]] = {
        "buckets": 1 << 16,
        "vocab": 100_000,
        "nnz": 16,
        "samples": 16384,
        "block_rows": 16,
        "zipf": 1.1,
    }

    def __init__(self, seed: int, options: dict[str, Any] | None = None) -> None:
        super().__init__(seed, options)
        b = int(self.opt["buckets"])
        if b < 2 or b & (b - 1):
            raise ValueError(f"buckets must be a power of two >= 2, got {b}")
        self.features: Ints = np.zeros((0, 0), np.int64)
        self.labels: F32 = np.zeros(0, np.float32)

    def tables(self) -> list[TableSpec]:
        return [TableSpec("w", int(self.opt["buckets"]), 1, int(self.opt["block_rows"]))]

    def init_params(self) -> list[F32]:
        return [np.zeros((int(self.opt["buckets"]), 1), np.float32)]

    def _generate(self) -> tuple[Ints, F32]:
        rng = self.rng(0xDA7A)
        n, nnz, buckets = int(self.opt["samples"]), int(self.opt["nnz"]), int(self.opt["buckets"])
        ids = 1 + zipf_ranks(rng, int(self.opt["vocab"]), float(self.opt["zipf"]), (n, nnz))
        features = hash_features(np.concatenate([np.zeros((n, 1), np.int64), ids], axis=1), buckets)
        truth = rng.normal(0.0, 1.0, buckets).astype(np.float32)
        logits = truth[features].sum(axis=1) / np.sqrt(nnz)
        labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
        return features, labels

    def load(self, worker: int, workers: int) -> None:
        features, labels = self._generate()
        self.features, self.labels = features[worker::workers], labels[worker::workers]

    def batch(self, worker: int, clock: int, size: int) -> Any:
        pick = self.rng(worker, clock).integers(0, len(self.labels), size)
        return self.features[pick], self.labels[pick]

    def rows(self, batch: Any) -> list[Ints]:
        return [np.unique(batch[0]).astype(np.int64)]

    def _margins(self, features: Ints, w: F32) -> F32:
        out: F32 = w[features, 0].sum(axis=1)
        return out

    def grad(self, batch: Any, params: list[F32]) -> tuple[list[F32], float]:
        features, labels = batch
        z = self._margins(features, params[0])
        p = 1.0 / (1.0 + np.exp(-z))
        err = ((p - labels) / len(labels)).astype(np.float32)
        _, g = rows_and_sum(features.ravel(), np.repeat(err, features.shape[1]), 1)
        loss = float(np.mean(np.logaddexp(0.0, z) - labels * z))
        return [g], loss

    def evaluate(self, params: list[F32]) -> dict[str, float]:
        features, labels = self._generate()
        z = self._margins(features, params[0])
        return {
            "logloss": float(np.mean(np.logaddexp(0.0, z) - labels * z)),
            "accuracy": float(np.mean((z > 0) == (labels > 0.5))),
        }
