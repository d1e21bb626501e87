"""Durations and byte sizes as people write them: ``"4h"``, ``"1h30m"``, ``"250ms"``, ``"512MiB"``.

The one parser of units for every layer (policies, the simulator, the shelf, the command line), so
``"15min"`` and ``"1GiB"`` mean the same everywhere. It imports nothing from crashsafe but the error
root, so the lowest layer may use it.
"""

from __future__ import annotations

import math
import re

from crashsafe.errors import CrashsafeError

__all__ = ["UnitError", "format_duration", "parse_duration", "parse_size"]


class UnitError(CrashsafeError, ValueError):
    """A duration or a size could not be read; the message names the value and the accepted forms."""


_SECONDS = {
    "ms": 1e-3, "s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0,
    "m": 60.0, "min": 60.0, "mins": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hr": 3600.0, "hrs": 3600.0, "hour": 3600.0, "hours": 3600.0,
    "d": 86400.0, "day": 86400.0, "days": 86400.0,
}
_DURATION_PART = re.compile(r"\s*(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+)\s*([a-zA-Z]*)")
_BYTES = {
    "": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_duration(value: float | int | str, name: str = "duration") -> float:
    """Seconds in ``value``: a number of seconds or a string such as ``"4h"`` or ``"1h30m"``.

    ``"inf"`` means never (an infinite MTBF). Raises :class:`UnitError` naming ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise UnitError(f"{name} must be a duration such as 30, '30s', '4h', got {value!r}")
    seconds = _duration_text(value.strip(), name) if isinstance(value, str) else float(value)
    if math.isnan(seconds) or seconds < 0:
        raise UnitError(f"{name} must be a non-negative duration, got {value!r}")
    return seconds


def _duration_text(text: str, name: str) -> float:
    if text.lower() in ("inf", "infinity", "never"):
        return math.inf
    total, pos = 0.0, 0
    while pos < len(text):
        match = _DURATION_PART.match(text, pos)
        if match is None or match.end() == pos:
            break
        number, unit = match.groups()
        factor = _SECONDS.get(unit.lower() if unit else "s")
        if factor is None:
            raise UnitError(
                f"{name}: unknown unit {unit!r} in {text!r}; use ms, s, min, h or d (e.g. '4h', '30s')"
            )
        total += float(number) * factor
        pos = match.end()
    if pos != len(text) or not text:
        raise UnitError(f"{name}: cannot read {text!r} as a duration; write e.g. 30, '30s', '15min', '4h'")
    return total


def format_duration(seconds: float) -> str:
    """A short human form: 90 -> '1.5min', 14400 -> '4h'."""
    if math.isinf(seconds):
        return "inf"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.3g}{unit}"
    return f"{seconds:.3g}s"


def parse_size(size: int | str, name: str = "size") -> int:
    """Bytes in ``size``: ``"1GiB"`` -> 1073741824, ``"2GB"`` -> 2000000000; ints pass through.

    Raises :class:`UnitError` (a ``ValueError``) naming ``name`` and the accepted forms.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = _SIZE.fullmatch(str(size))
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _BYTES:
            raise UnitError(f"{name} {size!r} is not a size; use bytes or e.g. '512MiB', '1GiB', '2GB'")
        value = int(float(match.group(1)) * _BYTES[unit])
    if value <= 0:
        raise UnitError(f"{name} must be positive, got {size!r}")
    return value
