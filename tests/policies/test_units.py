"""Durations as people write them."""

from __future__ import annotations

import math

import pytest

from crashsafe.policies import PolicyError, parse_duration
from crashsafe.policies.units import format_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("4h", 14400.0), ("15min", 900.0), ("30s", 30.0), ("1d", 86400.0), ("1h30m", 5400.0),
     ("250ms", 0.25), ("2.5", 2.5), (" 3 hours ", 10800.0), ("inf", math.inf), (12, 12.0)],
)
def test_parse(text: str | int, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "4x", "h", "-3s", "4h garbage", True, None, math.nan])
def test_bad_durations_name_the_problem(bad: object) -> None:
    with pytest.raises(PolicyError, match="mtbf"):
        parse_duration(bad, "mtbf")  # type: ignore[arg-type]


def test_format() -> None:
    assert [format_duration(s) for s in (30, 90, 14400, 2 * 86400, math.inf)] == [
        "30s", "1.5min", "4h", "2d", "inf"
    ]
