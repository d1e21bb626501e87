"""``crashsafe gc``'s retention options: the keep policies (crashsafe.policies) on the command line."""

from __future__ import annotations

from typing import Annotated

import typer

from crashsafe.cli._common import fail
from crashsafe.policies.errors import PolicyError
from crashsafe.policies.keep import (
    KeepBest,
    KeepEvery,
    KeepEveryInterval,
    KeepLast,
    KeepPolicy,
    KeepUnion,
    check_missing,
    check_mode,
)

__all__ = [
    "KeepBestOpt",
    "KeepEveryOpt",
    "KeepIntervalOpt",
    "KeepLastOpt",
    "KeepMetricOpt",
    "KeepMissingOpt",
    "KeepModeOpt",
    "keep_policy",
]

KeepLastOpt = Annotated[
    int | None,
    typer.Option(
        "--keep-last", help="keep the newest N steps (default 3 unless --keep-best or --keep-interval)"
    ),
]
KeepEveryOpt = Annotated[
    int | None, typer.Option("--keep-every", help="also keep every step that is a multiple of this")
]
KeepIntervalOpt = Annotated[
    str | None, typer.Option("--keep-interval", help="also keep one step per this much commit time, e.g. 1h")
]
KeepBestOpt = Annotated[
    int | None, typer.Option("--keep-best", help="also keep the N steps with the best --metric")
]
KeepMetricOpt = Annotated[
    str | None, typer.Option("--metric", help="the metric --keep-best ranks, e.g. val_loss")
]
KeepModeOpt = Annotated[
    str, typer.Option("--mode", help="for --keep-best: min (the lowest value is best, a loss) or max")
]
KeepMissingOpt = Annotated[
    str,
    typer.Option(
        "--missing", help="for --keep-best: keep steps without the metric, or drop them (to the others)"
    ),
]


def keep_policy(
    last: int | None,
    every: int | None,
    interval: str | None,
    best: int | None,
    metric: str | None,
    mode: str,
    missing: str,
) -> KeepPolicy:
    """The union of the policies the options name (the newest step is kept besides). A count below 1
    is refused here, with the one-line ``error:`` of every command (typer's own check printed a box)."""
    for option, value in (("--keep-last", last), ("--keep-every", every), ("--keep-best", best)):
        if value is not None and value < 1:
            raise fail(
                f"{option} {value}: give a whole number of at least 1 (gc always keeps the newest step; "
                "--keep-last 1 keeps only that one)"
            )
    if best is None and metric is not None:
        raise fail(f"--metric {metric} ranks steps for --keep-best; add --keep-best N")
    if last is None and best is None and interval is None:
        last = 3
    try:
        policies: list[KeepPolicy] = []
        if last is not None:
            policies.append(KeepLast(last))
        if every is not None:
            policies.append(KeepEvery(every))
        if interval is not None:
            policies.append(KeepEveryInterval(interval))
        if best is not None:
            if metric is None:
                raise fail("--keep-best needs --metric, the metric to rank steps by (e.g. --metric val_loss)")
            policies.append(
                KeepBest(best, metric, check_mode(mode, "--mode"), check_missing(missing, "--missing"))
            )
    except PolicyError as exc:
        raise fail(str(exc)) from None
    return policies[0] if len(policies) == 1 else KeepUnion(*policies)
