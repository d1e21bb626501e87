"""What the storage benchmark's parts share: places, units, and the interleaved runner."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).parent.parent
WORK = HERE / ".work" / "storage"
RESULTS = HERE / "results"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

Row = dict[str, float]


def interleaved(methods: dict[str, Callable[[str], Row]], repeat: int) -> dict[str, Row]:
    """Each repeat runs every method once, in a rotated order; keeps the best of each figure."""
    rows: dict[str, Row] = {}
    names = list(methods)
    for r in range(repeat):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            row = methods[name](f"{r}")
            best = rows.get(name)
            rows[name] = row if best is None else {k: min(v, best.get(k, v)) for k, v in row.items()}
            print(f"   {name:45s} " + " ".join(f"{k}={v:.3f}" for k, v in row.items()), flush=True)
    return rows


def same_model(a: dict[str, Any], b: dict[str, Any]) -> None:
    """The restored model equals the saved one (spot check: first and last layer)."""
    for i in (0, -1):
        assert torch.equal(a["model"][i].weight, b["model"][i].weight), "restore differs"


def size_name(size: int) -> str:
    if size >= GiB:
        return f"{size // GiB} GiB"
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"
