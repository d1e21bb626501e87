"""What to keep: the newest ``keep_last`` steps plus every multiple of ``keep_every``."""

from __future__ import annotations

__all__ = ["steps_to_delete", "validate_retention"]


def validate_retention(keep_last: int | None, keep_every: int | None) -> None:
    for name, value in (("keep_last", keep_last), ("keep_every", keep_every)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")


def steps_to_delete(
    steps: list[int],
    keep_last: int | None,
    keep_every: int | None,
    protected: frozenset[int] = frozenset(),
) -> list[int]:
    """Committed steps retention may delete. ``protected`` steps (e.g. delta bases) are kept."""
    if keep_last is None:
        return []
    ordered = sorted(steps)
    recent = set(ordered[-keep_last:])
    doomed = []
    for s in ordered:
        if s in recent or s in protected:
            continue
        if keep_every is not None and s % keep_every == 0:
            continue
        doomed.append(s)
    return doomed
