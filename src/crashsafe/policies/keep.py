"""What to keep: small retention policies, each naming the committed steps it keeps.

A policy sees the committed steps (ascending) and, on demand, each step's :class:`StepFacts` (its
commit time and metrics, read from its manifest once and cached by the caller), so a policy that
looks only at step numbers costs no reads. Retention keeps the union of what its policies keep,
plus the newest step, the step just saved and every delta base a kept step needs
(:func:`crashsafe.chain.doomed_steps`). Every policy here is stable: applied again to what it kept
(plus what others kept), it keeps the same steps, so deleting never cascades.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any, Literal

from crashsafe.policies.errors import PolicyError
from crashsafe.policies.units import parse_duration

__all__ = [
    "UNKNOWN",
    "Facts",
    "KeepBest",
    "KeepEvery",
    "KeepEveryInterval",
    "KeepLast",
    "KeepPolicy",
    "KeepUnion",
    "Missing",
    "Mode",
    "StepFacts",
    "check_metric",
    "check_missing",
    "check_mode",
    "metric_value",
    "ranked",
]

Mode = Literal["min", "max"]
Missing = Literal["keep", "drop"]


@dataclass(frozen=True)
class StepFacts:
    """What a keep policy may know about a committed step besides its number."""

    created: float  # commit time, seconds since the epoch; nan when the manifest cannot be read
    metrics: Mapping[str, Any] = field(default_factory=dict)


UNKNOWN = StepFacts(math.nan)  # a step whose manifest is damaged or gone
Facts = Callable[[int], StepFacts]


class KeepPolicy(abc.ABC):
    """Names the steps to keep; combine policies with ``|`` (or :class:`KeepUnion`)."""

    @abc.abstractmethod
    def keep(self, steps: Sequence[int], facts: Facts) -> Set[int]:
        """The steps of ``steps`` (committed, ascending) this policy keeps."""

    def __or__(self, other: KeepPolicy) -> KeepUnion:
        return KeepUnion(self, other)


def _count(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PolicyError(f"{name} must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class KeepLast(KeepPolicy):
    """The ``n`` newest steps (by step number)."""

    n: int

    def __post_init__(self) -> None:
        _count(self.n, "KeepLast(n)")

    def keep(self, steps: Sequence[int], facts: Facts) -> Set[int]:
        return frozenset(steps[-self.n :])


@dataclass(frozen=True)
class KeepEvery(KeepPolicy):
    """Every step that is a multiple of ``steps``."""

    steps: int

    def __post_init__(self) -> None:
        _count(self.steps, "KeepEvery(steps)")

    def keep(self, steps: Sequence[int], facts: Facts) -> Set[int]:
        return frozenset(s for s in steps if s % self.steps == 0)


@dataclass(frozen=True, init=False)
class KeepEveryInterval(KeepPolicy):
    """One step per ``seconds`` of commit time (TensorFlow's ``keep_checkpoint_every_n_hours``).

    Oldest commit first, the first step is kept, then each step committed at least ``seconds``
    after the last one kept. ``seconds`` is a number or a duration such as ``"1h"``. A step whose
    manifest cannot be read (no commit time) is not kept by this policy.
    """

    seconds: float

    def __init__(self, seconds: float | str) -> None:
        parsed = parse_duration(seconds, "KeepEveryInterval(seconds)")
        if not 0 < parsed < math.inf:
            raise PolicyError(f"KeepEveryInterval(seconds) must be positive and finite, got {seconds!r}")
        object.__setattr__(self, "seconds", parsed)

    def keep(self, steps: Sequence[int], facts: Facts) -> Set[int]:
        timed = sorted((created, s) for s in steps if math.isfinite(created := facts(s).created))
        kept: set[int] = set()
        last = -math.inf
        for created, step in timed:
            if created >= last + self.seconds:
                kept.add(step)
                last = created
        return kept


def metric_value(metrics: Mapping[str, Any], metric: str) -> float | None:
    """``metrics[metric]`` if it is a finite number, else None (missing, NaN, ±inf or not a number)."""
    value = metrics.get(metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def ranked(steps: Sequence[int], facts: Facts, metric: str, mode: Mode) -> list[int]:
    """The steps that record ``metric`` as a finite number, best first (ties: the newer step first)."""
    sign = 1.0 if mode == "min" else -1.0
    scored = []
    for step in steps:
        value = metric_value(facts(step).metrics, metric)
        if value is not None:
            scored.append((sign * value, -step))
    return [-negated for _, negated in sorted(scored)]


def check_mode(mode: object, where: str) -> Mode:
    """``mode`` if it is ``"min"`` or ``"max"``, else a PolicyError naming ``where``."""
    if mode == "min" or mode == "max":
        return mode
    raise PolicyError(
        f"{where}: mode must be 'min' (the lowest value is best, a loss) or 'max', got {mode!r}"
    )


def check_missing(missing: object, where: str) -> Missing:
    """``missing`` if it is ``"keep"`` or ``"drop"``, else a PolicyError naming ``where``."""
    if missing == "keep" or missing == "drop":
        return missing
    raise PolicyError(
        f"{where}: missing must be 'keep' or 'drop' (steps without the metric), got {missing!r}"
    )


def check_metric(metric: object, where: str) -> str:
    """``metric`` if it is a non-empty string, else a PolicyError naming ``where``."""
    if not isinstance(metric, str) or not metric:
        raise PolicyError(
            f"{where}: metric must be the name of a metric you save (e.g. 'val_loss'), got {metric!r}"
        )
    return metric


@dataclass(frozen=True)
class KeepBest(KeepPolicy):
    """The ``n`` steps with the best ``metric`` (``mode="min"``: lowest, ``"max"``: highest).

    A step without a finite value of ``metric`` (never recorded, NaN, ±inf, or its manifest cannot
    be read) is kept when ``missing="keep"`` (the default: retention never deletes what it cannot
    rank, so a misspelt metric deletes nothing) and left to the other policies when ``"drop"``
    (use it when the metric is recorded at some saves only). Ties go to the newer step.
    """

    n: int
    metric: str
    mode: Mode = "min"
    missing: Missing = "keep"

    def __post_init__(self) -> None:
        _count(self.n, "KeepBest(n)")
        check_metric(self.metric, "KeepBest")
        check_mode(self.mode, "KeepBest")
        check_missing(self.missing, "KeepBest")

    def keep(self, steps: Sequence[int], facts: Facts) -> Set[int]:
        best = ranked(steps, facts, self.metric, self.mode)
        kept = set(best[: self.n])
        if self.missing == "keep":
            kept.update(set(steps) - set(best))
        return kept


class KeepUnion(KeepPolicy):
    """Every step that any of the policies keeps."""

    def __init__(self, *policies: KeepPolicy) -> None:
        if not policies:
            raise PolicyError("KeepUnion(...) needs at least one policy")
        flat: list[KeepPolicy] = []
        for policy in policies:
            if not isinstance(policy, KeepPolicy):
                raise PolicyError(
                    f"{policy!r} is not a keep policy; use KeepLast, KeepEvery, KeepEveryInterval, KeepBest"
                )
            flat.extend(policy.policies if isinstance(policy, KeepUnion) else (policy,))
        self.policies: tuple[KeepPolicy, ...] = tuple(flat)

    def keep(self, steps: Sequence[int], facts: Facts) -> Set[int]:
        kept: set[int] = set()
        for policy in self.policies:
            kept.update(policy.keep(steps, facts))
        return kept

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeepUnion) and self.policies == other.policies

    def __hash__(self) -> int:
        return hash(self.policies)

    def __repr__(self) -> str:
        return " | ".join(map(repr, self.policies))
