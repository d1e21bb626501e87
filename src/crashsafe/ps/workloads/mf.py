"""Matrix factorization of generated ratings whose item popularity is Zipfian.

Ratings are ``u . v + noise`` for hidden rank-``rank`` factors; users are uniform, items are drawn
by a Zipf(``zipf``) law over a random permutation (so popular items spread over all servers).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from crashsafe.ps.layout import TableSpec
from crashsafe.ps.workloads.base import F32, Ints, Workload, rows_and_sum, zipf_ranks

__all__ = ["MatrixFactorization"]


class MatrixFactorization(Workload):
    """Squared loss with L2 on the touched rows; tables ``user`` and ``item``."""

    defaults: ClassVar[dict[str, float]] = {
        "users": 600,
        "items": 1200,
        "rank": 8,
        "ratings": 40000,
        "block_rows": 16,
        "zipf": 1.0,
        "reg": 0.01,
    }

    def __init__(self, seed: int, options: dict[str, Any] | None = None) -> None:
        super().__init__(seed, options)
        self.data: tuple[Ints, Ints, F32] = (
            np.zeros(0, np.int64),
            np.zeros(0, np.int64),
            np.zeros(0, np.float32),
        )

    def tables(self) -> list[TableSpec]:
        r, b = int(self.opt["rank"]), int(self.opt["block_rows"])
        return [
            TableSpec("user", int(self.opt["users"]), r, b),
            TableSpec("item", int(self.opt["items"]), r, b),
        ]

    def init_params(self) -> list[F32]:
        rng = self.rng(0x1417)
        return [rng.normal(0.0, 0.1, (t.rows, t.dim)).astype(np.float32) for t in self.tables()]

    def _generate(self) -> tuple[Ints, Ints, F32]:
        rng = self.rng(0xDA7A)
        users, items, rank = int(self.opt["users"]), int(self.opt["items"]), int(self.opt["rank"])
        n = int(self.opt["ratings"])
        u_true = rng.normal(0.0, rank**-0.25, (users, rank))
        v_true = rng.normal(0.0, rank**-0.25, (items, rank))
        user = rng.integers(0, users, n).astype(np.int64)
        item = rng.permutation(items).astype(np.int64)[zipf_ranks(rng, items, float(self.opt["zipf"]), n)]
        rating = (np.sum(u_true[user] * v_true[item], axis=1) + 0.1 * rng.normal(size=n)).astype(np.float32)
        return user, item, rating

    def load(self, worker: int, workers: int) -> None:
        user, item, rating = self._generate()
        self.data = (user[worker::workers], item[worker::workers], rating[worker::workers])

    def batch(self, worker: int, clock: int, size: int) -> Any:
        pick = self.rng(worker, clock).integers(0, len(self.data[2]), size)
        return tuple(a[pick] for a in self.data)

    def rows(self, batch: Any) -> list[Ints]:
        return [np.unique(batch[0]).astype(np.int64), np.unique(batch[1]).astype(np.int64)]

    def grad(self, batch: Any, params: list[F32]) -> tuple[list[F32], float]:
        user, item, rating = batch
        u, v = params[0][user], params[1][item]
        err = np.sum(u * v, axis=1) - rating
        reg, n = np.float32(self.opt["reg"]), np.float32(len(rating))
        _, gu = rows_and_sum(user, (err[:, None] * v + reg * u) / n, u.shape[1])
        _, gv = rows_and_sum(item, (err[:, None] * u + reg * v) / n, v.shape[1])
        return [gu, gv], float(np.mean(err * err))

    def evaluate(self, params: list[F32]) -> dict[str, float]:
        user, item, rating = self._generate()
        err = np.sum(params[0][user] * params[1][item], axis=1) - rating
        return {"rmse": float(np.sqrt(np.mean(err * err)))}
