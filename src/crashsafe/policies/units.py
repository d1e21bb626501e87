"""Durations as people write them: ``4h``, ``15min``, ``30s``, ``1d``, ``1h30m`` or plain seconds."""

from __future__ import annotations

import math
import re

from crashsafe.policies.errors import PolicyError

__all__ = ["format_duration", "parse_duration"]

_UNITS = {
    "ms": 1e-3, "s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0,
    "m": 60.0, "min": 60.0, "mins": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hr": 3600.0, "hrs": 3600.0, "hour": 3600.0, "hours": 3600.0,
    "d": 86400.0, "day": 86400.0, "days": 86400.0,
}
_PART = re.compile(r"\s*(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+)\s*([a-zA-Z]*)")


def parse_duration(value: float | int | str, name: str = "duration") -> float:
    """Seconds in ``value``: a number of seconds or a string such as ``"4h"`` or ``"1h30m"``.

    ``"inf"`` means never (an infinite MTBF). Raises :class:`PolicyError` naming ``name``.
    """
    if isinstance(value, bool):
        raise PolicyError(f"{name} must be a duration such as 30, '30s', '4h', got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _parse_text(value.strip(), name)
    else:
        raise PolicyError(f"{name} must be a duration such as 30, '30s', '4h', got {value!r}")
    if math.isnan(seconds) or seconds < 0:
        raise PolicyError(f"{name} must be a non-negative duration, got {value!r}")
    return seconds


def _parse_text(text: str, name: str) -> float:
    if text.lower() in ("inf", "infinity", "never"):
        return math.inf
    total, pos = 0.0, 0
    while pos < len(text):
        match = _PART.match(text, pos)
        if match is None or match.end() == pos:
            break
        number, unit = match.groups()
        factor = _UNITS.get(unit.lower() if unit else "s")
        if factor is None:
            raise PolicyError(
                f"{name}: unknown unit {unit!r} in {text!r}; use ms, s, min, h or d (e.g. '4h', '30s')"
            )
        total += float(number) * factor
        pos = match.end()
    if pos != len(text) or not text:
        raise PolicyError(f"{name}: cannot read {text!r} as a duration; write e.g. 30, '30s', '15min', '4h'")
    return total


def format_duration(seconds: float) -> str:
    """A short human form: 90 -> '1.5min', 14400 -> '4h'."""
    if math.isinf(seconds):
        return "inf"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.3g}{unit}"
    return f"{seconds:.3g}s"
