"""Matrix factorization on a generated ratings matrix, trained with minibatch SGD.

The data (generated, nothing downloads): ``users x items`` true ratings are a rank-``rank`` product
of Gaussian factors plus Gaussian noise (``noise``). Which entries are observed follows Zipfian
popularity: item ``j`` is picked with probability proportional to ``1 / (j + 1) ** zipf_items``,
user ``i`` proportional to ``1 / (i + 1) ** zipf_users`` (both orders shuffled), ``ratings``
draws in all (duplicates merged). The model learns ``P`` (users x dim) and ``Q`` (items x dim) by
SGD on the summed squared error of a minibatch, with L2 on the rows it touches, so each iteration
changes only the rows of the users and items in its batch, as on a parameter server.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from crashsafe.workloads.job import Job, minibatch

__all__ = ["MatFact", "make", "ratings"]


def ratings(
    seed: int = 0,
    users: int = 1000,
    items: int = 800,
    rank: int = 8,
    count: int = 60_000,
    noise: float = 0.3,
    zipf_users: float = 0.8,
    zipf_items: float = 1.0,
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(user ids, item ids, ratings) of the generated matrix, as described in the module doc."""
    rng = np.random.default_rng(seed)
    u_fac = rng.standard_normal((users, rank)) / np.sqrt(rank)
    i_fac = rng.standard_normal((items, rank))
    pu = 1.0 / np.arange(1, users + 1) ** zipf_users
    pi = 1.0 / np.arange(1, items + 1) ** zipf_items
    u = rng.permutation(users)[rng.choice(users, size=count, p=pu / pu.sum())]
    i = rng.permutation(items)[rng.choice(items, size=count, p=pi / pi.sum())]
    key = np.unique(u.astype(np.int64) * items + i)
    u, i = key // items, key % items
    r = np.sum(u_fac[u] * i_fac[i], axis=1) + noise * rng.standard_normal(u.size)
    return u, i, r.astype(np.float32)


class MatFact(Job):
    """P, Q embeddings (``dim`` wide) fitted to the ratings with SGD(lr) on minibatches."""

    name = "matfact"

    def __init__(
        self, seed: int = 0, dim: int = 16, lr: float = 0.01, l2: float = 1e-3, batch: int = 1024
    ) -> None:
        import torch

        self.seed, self.batch, self.l2 = seed, batch, l2
        u, i, r = ratings(seed)
        self.u, self.i, self.r = torch.tensor(u), torch.tensor(i), torch.tensor(r)
        torch.manual_seed(seed)
        self.model = torch.nn.ModuleDict(
            {"P": torch.nn.Embedding(int(u.max()) + 1, dim), "Q": torch.nn.Embedding(int(i.max()) + 1, dim)}
        )
        with torch.no_grad():
            for table in self.model.values():
                table.weight.mul_(0.1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)

    def _error(self, rows: Any) -> Any:
        p, q = self.model["P"](self.u[rows]), self.model["Q"](self.i[rows])
        return (p * q).sum(dim=1) - self.r[rows], p, q

    def step(self, iteration: int) -> None:
        import torch

        rows = torch.as_tensor(minibatch(self.seed, iteration, self.batch, len(self.r)))
        err, p, q = self._error(rows)
        loss = err.pow(2).sum() + self.l2 * (p.pow(2).sum() + q.pow(2).sum())  # per-rating SGD steps
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

    def loss(self) -> float:
        import torch

        with torch.no_grad():
            err, _, _ = self._error(slice(None))
            return float(err.pow(2).mean())


def make(seed: int = 0, **kwargs: Any) -> MatFact:
    return MatFact(seed, **kwargs)
