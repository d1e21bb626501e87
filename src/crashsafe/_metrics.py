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
            number = _number(value)
        except OverflowError:  # an int past a float's range (10**400): it was an OverflowError traceback
            raise UnsupportedStateError(
                f"metric {key!r} = {value!r} is too large for a float (metrics are stored as floats); "
                "pass a smaller number, or leave the metric out"
            ) from None
        if number is None:
            raise UnsupportedStateError(
                f"metric {key!r} = {value!r} is not a number; metrics hold numbers only (a string such as "
                "'0.1' or a bool is not one: pass float(value), or leave the metric out)"
            )
        name = str(key)  # the manifest's keys are text
        if name in clean:  # {1: 0.5, "1": 0.7}: one of them would silently replace the other
            raise UnsupportedStateError(
                f"metrics {_first(metrics, name)!r} and {key!r} are both stored as {name!r} (metric names "
                "are stored as text); give them distinct names"
            )
        clean[name] = number if math.isfinite(number) else repr(number)
    return clean


def _first(metrics: Mapping[str, Any], name: str) -> Any:
    """The first key of ``metrics`` stored as ``name``."""
    return next(key for key in metrics if str(key) == name)


def _number(value: object) -> float | None:
    """``value`` as a float if it is a number (an int, a float, a numpy or torch scalar), else None.
    Text and truth values are not numbers, though ``float()`` reads ``"0.1"`` and ``True``: ranked as
    numbers, they would decide which steps retention keeps."""
    if isinstance(value, (str, bytes, bytearray, bool)) or str(getattr(value, "dtype", "")) in _BOOLS:
        return None
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


_BOOLS = ("bool", "torch.bool")  # numpy's and torch's truth values (np.True_ is no bool)
