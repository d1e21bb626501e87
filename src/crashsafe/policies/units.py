"""Durations for the save policies: ``4h``, ``15min``, ``30s``, ``1d``, ``1h30m`` or plain seconds.

The parser is crashsafe's one units parser (:mod:`crashsafe._units`); here a value it cannot read is
a :class:`PolicyError`, the error every policy raises for an impossible setting.
"""

from __future__ import annotations

from crashsafe._units import UnitError, format_duration
from crashsafe._units import parse_duration as _parse_duration
from crashsafe.policies.errors import PolicyError

__all__ = ["format_duration", "parse_duration"]


def parse_duration(value: float | int | str, name: str = "duration") -> float:
    """Seconds in ``value``: a number of seconds or a string such as ``"4h"`` or ``"1h30m"``.

    ``"inf"`` means never (an infinite MTBF). Raises :class:`PolicyError` naming ``name``.
    """
    try:
        return _parse_duration(value, name)
    except UnitError as exc:
        raise PolicyError(str(exc)) from None
