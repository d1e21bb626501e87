"""Gaussian mixture with full covariances, fitted by EM in numpy/scipy, one checkpointable step at
a time.

The formulas are scikit-learn's ``GaussianMixture(covariance_type="full")``: the E-step through
the Cholesky factors of the precisions, the M-step with ``reg_covar`` added to each covariance's
diagonal, and the stop rule ``|lower_bound - previous| < tol``. Given the same initial weights,
means and precisions both reach the same model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from crashsafe.workloads.iterative import Allocate, numpy_arrays

__all__ = ["GMM", "e_step", "m_step", "precision_cholesky"]

_Array = np.ndarray[Any, Any]


def precision_cholesky(covariances: _Array) -> _Array:
    """Per component, the upper-triangular ``U`` with ``U @ U.T == inv(covariance)``."""
    from scipy import linalg

    d = covariances.shape[-1]
    out = np.empty_like(covariances)
    for k, cov in enumerate(covariances):
        try:
            chol = linalg.cholesky(cov, lower=True)
        except linalg.LinAlgError:
            raise ValueError(f"component {k}'s covariance is not positive definite; raise reg_covar"
                             ) from None
        out[k] = linalg.solve_triangular(chol, np.eye(d), lower=True).T
    return out


def e_step(x: _Array, weights: _Array, means: _Array, prec_chol: _Array) -> tuple[float, _Array]:
    """(mean log-likelihood of ``x``, log responsibilities)."""
    from scipy.special import logsumexp

    n, d = x.shape
    log_prob = np.empty((n, len(means)))
    for k, (mu, prec) in enumerate(zip(means, prec_chol, strict=True)):
        y = x @ prec - mu @ prec
        log_prob[:, k] = np.sum(np.square(y), axis=1)
    log_det = np.sum(np.log(prec_chol.reshape(len(means), -1)[:, :: d + 1]), axis=1)
    weighted = -0.5 * (d * np.log(2 * np.pi) + log_prob) + log_det + np.log(weights)
    log_norm = logsumexp(weighted, axis=1)
    return float(np.mean(log_norm)), weighted - log_norm[:, None]


def m_step(x: _Array, log_resp: _Array, reg_covar: float, out: Allocate | None = None
           ) -> tuple[_Array, _Array, _Array]:
    """(weights, means, covariances) from the responsibilities, in arrays from ``out``."""
    alloc = out or numpy_arrays
    resp = np.exp(log_resp)
    nk = resp.sum(axis=0) + 10 * np.finfo(resp.dtype).eps
    k, d = len(nk), x.shape[1]
    means = np.divide(resp.T @ x, nk[:, None], out=alloc("means", (k, d)))
    covariances = alloc("covariances", (k, d, d))
    for j in range(k):
        diff = x - means[j]
        np.dot(resp[:, j] * diff.T, diff, out=covariances[j])
        covariances[j] /= nk[j]
        covariances[j].flat[:: d + 1] += reg_covar
    return np.divide(nk, nk.sum(), out=alloc("weights", (k,))), means, covariances


@dataclass(frozen=True)
class GMM:
    """EM for ``k`` full-covariance components; ``tol=None`` runs exactly ``max_iter`` iterations.

    Initial model: equal weights, ``k`` distinct data points (chosen by ``seed``) as means, and the
    average per-feature variance times the identity as every covariance. State: ``weights``,
    ``means``, ``covariances``, ``lower_bound`` (of the model before the last step), ``iteration``,
    ``done``.
    """

    k: int
    seed: int = 0
    tol: float | None = 1e-3
    reg_covar: float = 1e-6

    name = "gmm"

    def initial_model(self, x: _Array) -> tuple[_Array, _Array, _Array]:
        """(weights, means, covariances) the fit starts from."""
        if not 1 <= self.k <= len(x):
            raise ValueError(f"k must be between 1 and the number of points ({len(x)}), got {self.k}")
        d = x.shape[1]
        means = np.array(x[np.random.default_rng(self.seed).choice(len(x), self.k, replace=False)],
                         dtype=np.float64)
        scale = float(np.var(x, axis=0).mean()) + self.reg_covar
        covariances = np.repeat(np.eye(d)[None] * scale, self.k, axis=0)
        return np.full(self.k, 1.0 / self.k), means, covariances

    def init_state(self, x: _Array) -> dict[str, Any]:
        weights, means, covariances = self.initial_model(x)
        return {"weights": weights, "means": means, "covariances": covariances,
                "lower_bound": float("-inf"), "iteration": 0, "done": False}

    def step(self, x: _Array, state: dict[str, Any], out: Allocate | None = None) -> dict[str, Any]:
        """One EM step from ``state``; returns the next state, its arrays from ``out(name, shape)``
        (e.g. a shelf's ``empty``, so the model is computed in place) or new numpy arrays."""
        prec_chol = precision_cholesky(state["covariances"])
        lower_bound, log_resp = e_step(x, state["weights"], state["means"], prec_chol)
        weights, means, covariances = m_step(x, log_resp, self.reg_covar, out)
        change = lower_bound - float(state["lower_bound"])
        done = self.tol is not None and abs(change) < self.tol
        return {"weights": weights, "means": means, "covariances": covariances, "lower_bound": lower_bound,
                "iteration": int(state["iteration"]) + 1, "done": bool(done)}
