"""What a parameter-server workload provides: its tables, initial values, data and gradients.

Every minibatch is a pure function of ``(seed, worker, clock)``, so a rerun (or a relaunched
worker) computes exactly the same gradients from the same parameter values.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from crashsafe.ps.layout import TableSpec

__all__ = ["F32", "Ints", "Workload", "zipf_ranks"]

F32 = NDArray[np.float32]
Ints = NDArray[np.int64]


class Workload(ABC):
    """A training job on tables of rows. ``options`` overrides the subclass's size defaults."""

    defaults: ClassVar[Mapping[str, float]] = {}

    def __init__(self, seed: int, options: Mapping[str, Any] | None = None) -> None:
        unknown = set(options or {}) - set(self.defaults)
        if unknown:
            raise ValueError(f"unknown workload options {sorted(unknown)}; known: {sorted(self.defaults)}")
        self.seed = seed
        self.opt = {**self.defaults, **(options or {})}

    def rng(self, *salt: int) -> np.random.Generator:
        """Deterministic generator for ``salt`` (e.g. worker, clock) under this job's seed."""
        return np.random.default_rng([self.seed, *salt])

    @abstractmethod
    def tables(self) -> list[TableSpec]:
        """The parameter tables, in layout order."""

    @abstractmethod
    def init_params(self) -> list[F32]:
        """Initial value of every table (deterministic from the seed)."""

    @abstractmethod
    def load(self, worker: int, workers: int) -> None:
        """Generate or load this worker's data shard."""

    @abstractmethod
    def batch(self, worker: int, clock: int, size: int) -> Any:
        """The minibatch of ``worker`` at ``clock``."""

    @abstractmethod
    def rows(self, batch: Any) -> list[Ints]:
        """Sorted unique rows of each table the minibatch touches."""

    @abstractmethod
    def grad(self, batch: Any, params: list[F32]) -> tuple[list[F32], float]:
        """Gradient rows (aligned with :meth:`rows`) and the minibatch loss; ``params`` are full tables."""

    @abstractmethod
    def evaluate(self, params: list[F32]) -> dict[str, float]:
        """Quality of the full model on held-out or all data."""


def zipf_ranks(rng: np.random.Generator, n: int, exponent: float, size: int | tuple[int, ...]) -> Ints:
    """Draw ranks ``0..n-1`` with probability proportional to ``(rank + 1) ** -exponent``."""
    cdf = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -exponent)
    ranks: Ints = np.minimum(np.searchsorted(cdf, rng.random(size) * cdf[-1]), n - 1).astype(np.int64)
    return ranks


def rows_and_sum(keys: Ints, values: NDArray[np.float32], dim: int) -> tuple[Ints, F32]:
    """Unique sorted ``keys`` and the per-key sums of ``values`` (``len(keys) x dim``)."""
    rows, inverse = np.unique(keys, return_inverse=True)
    out = np.zeros((rows.size, dim), dtype=np.float32)
    np.add.at(out, inverse.ravel(), values.reshape(-1, dim))
    return rows.astype(np.int64), out
