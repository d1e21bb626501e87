"""crashsafe's one units parser: durations and byte sizes, and the error each layer turns it into."""

from __future__ import annotations

import math

import pytest

from crashsafe._units import UnitError, format_duration, parse_duration, parse_size
from crashsafe.errors import CrashsafeError
from crashsafe.policies import PolicyError
from crashsafe.policies import parse_duration as policy_duration
from crashsafe.sim import Exponential, SimulationError


@pytest.mark.parametrize(
    ("text", "size"),
    [("1GiB", 2**30), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), (" 1.5 kib ", 1536), ("4096", 4096),
     (4096, 4096), ("3t", 3 * 10**12), ("1b", 1)],
)
def test_sizes(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["", "1XB", "GiB", "-1MiB", "0", 0, True, "1 GiB extra"])
def test_bad_sizes_are_value_errors_naming_the_forms(bad: object) -> None:
    with pytest.raises(UnitError, match="size") as info:
        parse_size(bad, "size")  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError) and isinstance(info.value, CrashsafeError)


def test_durations_and_their_short_form() -> None:
    assert parse_duration("1h30m") == 5400.0 and parse_duration("inf") == math.inf
    assert format_duration(parse_duration("90s")) == "1.5min"
    with pytest.raises(UnitError, match="restart"):
        parse_duration("4 fortnights", "restart")


def test_each_layer_keeps_its_own_error() -> None:
    with pytest.raises(PolicyError, match="mtbf"):
        policy_duration("-4h", "mtbf")
    with pytest.raises(SimulationError, match="mtbf"):
        _ = Exponential("4 fortnights").mtbf
