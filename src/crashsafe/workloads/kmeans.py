"""KMeans by Lloyd's algorithm in numpy, one checkpointable iteration at a time.

It follows scikit-learn's dense Lloyd (``algorithm="lloyd"``) step for step, so both reach the same
centers from the same initial centers: labels from ``argmin(||c||^2 - 2 x.c)``, empty clusters
relocated to the points farthest from their centers, and the stop rule ``sum ||c_new - c||^2 <=
tol * mean(var(X))``. The state between iterations is small and explicit, so a run resumed from
any iteration's checkpoint continues bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from crashsafe.workloads.iterative import Allocate, numpy_arrays

__all__ = ["KMeans", "assign", "init_centers"]

_Array = np.ndarray[Any, Any]


def init_centers(x: _Array, k: int, seed: int) -> _Array:
    """``k`` distinct data points chosen by ``seed``."""
    if not 1 <= k <= len(x):
        raise ValueError(f"k must be between 1 and the number of points ({len(x)}), got {k}")
    return np.array(x[np.random.default_rng(seed).choice(len(x), k, replace=False)], dtype=np.float64)


def assign(x: _Array, centers: _Array) -> tuple[_Array, _Array]:
    """(labels, squared distance of each point to its center)."""
    scores = np.einsum("ij,ij->i", centers, centers)[None, :] - 2.0 * (x @ centers.T)
    labels = np.argmin(scores, axis=1)
    x_sq = np.einsum("ij,ij->i", x, x)
    return labels, np.maximum(scores[np.arange(len(x)), labels] + x_sq, 0.0)


@dataclass(frozen=True)
class KMeans:
    """Lloyd iterations for ``k`` clusters; ``tol=None`` runs exactly ``max_iter`` iterations.

    State: ``centers`` (k x d), ``iteration`` (steps done), ``shift`` (squared movement of the
    centers in the last step), ``inertia`` (of the centers before the last step), ``done``.
    """

    k: int
    seed: int = 0
    tol: float | None = 1e-4

    name = "kmeans"

    def init_state(self, x: _Array) -> dict[str, Any]:
        return {"centers": init_centers(x, self.k, self.seed), "iteration": 0, "shift": float("inf"),
                "inertia": float("inf"), "done": False}

    def step(self, x: _Array, state: dict[str, Any], out: Allocate | None = None) -> dict[str, Any]:
        """One Lloyd step from ``state``; returns the next state. Its arrays come from
        ``out(name, shape)`` (e.g. a shelf's ``empty``, so the state is computed in place), or are
        new numpy arrays."""
        centers = state["centers"]
        labels, sq_dist = assign(x, centers)
        counts = np.bincount(labels, minlength=self.k).astype(np.float64)
        members = np.zeros((self.k, len(x)))
        members[labels, np.arange(len(x))] = 1.0
        sums = members @ x
        _relocate_empty(x, centers, labels, sq_dist, sums, counts)
        new = np.divide(sums, counts[:, None], out=(out or numpy_arrays)("centers", centers.shape))
        shift = float(((new - centers) ** 2).sum())
        iteration = int(state["iteration"]) + 1
        done = self.tol is not None and shift <= self.tol * float(np.var(x, axis=0).mean())
        return {"centers": new, "iteration": iteration, "shift": shift, "inertia": float(sq_dist.sum()),
                "done": bool(done)}


def _relocate_empty(x: _Array, centers: _Array, labels: _Array, sq_dist: _Array, sums: _Array,
                    counts: _Array) -> None:
    """scikit-learn's rule: each empty cluster takes one of the points farthest from its center."""
    empty = np.flatnonzero(counts == 0)
    if len(empty) == 0:
        return
    far = np.argpartition(sq_dist, -len(empty))[: -len(empty) - 1 : -1]
    for cluster, point in zip(empty, far, strict=True):
        old = labels[point]
        sums[old] -= x[point]
        counts[old] -= 1
        sums[cluster] = x[point]
        counts[cluster] = 1
