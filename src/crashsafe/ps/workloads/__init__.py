"""Reference parameter-server workloads: sparse LR (hashed, Zipfian), matrix factorization, digits MLP."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from crashsafe.ps.workloads.base import Workload
from crashsafe.ps.workloads.digits import DigitsMLP
from crashsafe.ps.workloads.mf import MatrixFactorization
from crashsafe.ps.workloads.sparse_lr import SparseLR

__all__ = ["WORKLOADS", "Workload", "make_workload"]

WORKLOADS: dict[str, type[Workload]] = {"sparse_lr": SparseLR, "mf": MatrixFactorization, "digits": DigitsMLP}


def make_workload(name: str, seed: int, options: Mapping[str, Any] | None = None) -> Workload:
    """Instantiate a workload by name (``sparse_lr``, ``mf``, ``digits``)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    return WORKLOADS[name](seed, dict(options or {}))
