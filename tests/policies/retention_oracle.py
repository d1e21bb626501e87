"""An oracle for retention, written apart from the implementation: what each keep policy keeps by
its documented definition, and what retention as a whole must keep."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from crashsafe.policies import (
    KeepBest,
    KeepEvery,
    KeepEveryInterval,
    KeepLast,
    KeepPolicy,
    KeepUnion,
    StepFacts,
)


def _value(metrics: dict[str, Any], metric: str) -> float | None:
    v = metrics.get(metric)
    return float(v) if type(v) in (int, float) and math.isfinite(v) else None


def oracle_keep(policy: KeepPolicy, steps: list[int], facts: dict[int, StepFacts]) -> set[int]:
    """What ``policy`` keeps, by its documented definition (written apart from the implementation)."""
    if isinstance(policy, KeepUnion):
        return set().union(*(oracle_keep(p, steps, facts) for p in policy.policies))
    if isinstance(policy, KeepLast):
        return set(sorted(steps)[-policy.n :])
    if isinstance(policy, KeepEvery):
        return {s for s in steps if s % policy.steps == 0}
    if isinstance(policy, KeepEveryInterval):  # the earliest commit at or after each floor
        timed = [(facts[s].created, s) for s in steps if math.isfinite(facts[s].created)]
        kept, floor = set(), -math.inf
        while (nxt := min((t for t in timed if t[0] >= floor), default=None)) is not None:
            kept.add(nxt[1])
            floor = nxt[0] + policy.seconds
        return kept
    assert isinstance(policy, KeepBest)
    values = {s: v for s in steps if (v := _value(dict(facts[s].metrics), policy.metric)) is not None}
    sign = 1 if policy.mode == "min" else -1

    def beaten_by(s: int) -> int:
        return sum(1 for t, v in values.items() if sign * v < sign * values[s] or (v == values[s] and t > s))

    kept = {s for s in values if beaten_by(s) < policy.n}
    return kept | ({s for s in steps if s not in values} if policy.missing == "keep" else set())


def expected_kept(
    steps: Sequence[int],
    facts: dict[int, StepFacts],
    bases: dict[int, set[int]],
    policy: KeepPolicy,
    pinned: set[int],
) -> set[int]:
    """What retention must keep: the policy's steps, the newest, the pinned, and their delta bases."""
    kept = oracle_keep(policy, sorted(steps), facts) | {max(steps)} | (pinned & set(steps))
    todo = list(kept)
    while todo:
        for base in bases[todo.pop()] - kept:
            kept.add(base)
            todo.append(base)
    return kept & set(steps)
