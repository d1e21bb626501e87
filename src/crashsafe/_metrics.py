"""The metrics a step is saved with: a flat dict of numbers (non-finite ones kept as their repr)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from crashsafe.errors import UnsupportedStateError

__all__ = ["clean_metrics"]


def clean_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """``metrics`` as the manifest stores them, or an UnsupportedStateError naming what is not a number."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise UnsupportedStateError(f"metrics must be a dict of numbers, got {metrics!r}")
    clean: dict[str, Any] = {}
    for key, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise UnsupportedStateError(
                f"metric {key!r} = {value!r} is not a number; metrics hold numbers only"
            ) from None
        clean[str(key)] = number if math.isfinite(number) else repr(number)
    return clean
