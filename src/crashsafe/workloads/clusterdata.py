"""Data for the clustering workloads; all of it ships offline or is generated from a seed.

- ``digits``: scikit-learn's bundled handwritten digits, 1797 x 64, pixel values 0..16 (real data).
- ``mnist_like``: generated data of MNIST's shape (70000 x 784 in [0, 1], 256 grey levels): ten
  smooth random 28 x 28 "prototype" images, each sample one prototype plus pixel noise, clipped and
  quantised like MNIST's bytes. Only the shape and value range imitate MNIST; no MNIST is used.
- ``blobs``: small isotropic Gaussian clusters, for fast tests.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["blobs", "digits", "load", "mnist_like"]

_Array = np.ndarray[Any, Any]


def digits() -> _Array:
    from sklearn.datasets import load_digits

    return np.asarray(load_digits().data, dtype=np.float64)


def mnist_like(n: int = 70_000, side: int = 28, classes: int = 10, seed: int = 0) -> _Array:
    """``n`` x ``side**2`` float64 images in [0, 1] with 256 levels (see the module docstring)."""
    rng = np.random.default_rng(seed)
    raw = rng.standard_normal((classes, side + 6, side + 6))
    kernel = np.exp(-0.5 * (np.arange(-3, 4) / 1.5) ** 2)
    smooth = np.apply_along_axis(np.convolve, 1, raw, kernel, mode="valid")
    smooth = np.apply_along_axis(np.convolve, 2, smooth, kernel, mode="valid")
    prototypes = np.clip(smooth / smooth.std() * 0.35 + 0.15, 0.0, 1.0).reshape(classes, -1)
    out = prototypes[rng.integers(0, classes, n)]
    out += rng.standard_normal(out.shape) * 0.1
    np.clip(out, 0.0, 1.0, out=out)
    quantised: _Array = np.round(out * 255.0) / 255.0
    return quantised


def blobs(n: int, d: int, clusters: int, seed: int = 0) -> _Array:
    """``n`` points in ``d`` dimensions around ``clusters`` random centers (unit spread)."""
    rng = np.random.default_rng(seed)
    centers = rng.uniform(-10, 10, (clusters, d))
    return centers[rng.integers(0, clusters, n)] + rng.standard_normal((n, d))


def load(spec: str) -> _Array:
    """``digits``, ``mnist_like[:N]`` or ``blobs:N:D:C[:seed]`` -> data."""
    name, *args = spec.split(":")
    if name == "digits" and not args:
        return digits()
    if name == "mnist_like" and len(args) <= 1:
        return mnist_like(n=int(args[0]) if args else 70_000)
    if name == "blobs" and len(args) in (3, 4):
        return blobs(*(int(a) for a in args))
    raise ValueError(f"unknown data {spec!r}; use digits, mnist_like[:N] or blobs:N:D:CLUSTERS[:SEED]")
