"""When to save: small policies with ``should_save(context) -> bool``, and their combinators.

The manager fills a :class:`SaveContext` (step, training time, measured costs, metrics) on every
``maybe_save`` call; a policy only decides.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

__all__ = ["AllOf", "AnyOf", "EverySeconds", "EverySteps", "SaveContext", "SavePolicy"]


@dataclass(frozen=True)
class SaveContext:
    """What a policy may look at. Times are seconds; ``train_time`` excludes checkpoint stalls."""

    step: int
    train_time: float
    last_save_step: int | None = None
    last_save_train_time: float | None = None
    stall: float | None = None
    persist: float | None = None
    saves: int = 0
    metrics: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class SavePolicy(Protocol):
    """Decides, at a step boundary, whether to checkpoint now."""

    def should_save(self, context: SaveContext) -> bool: ...


def _positive(value: float, name: str) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


@dataclass(frozen=True)
class EverySteps:
    """Save when ``step`` is a multiple of ``n`` (and at the first call)."""

    n: int

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"EverySteps needs an int n >= 1, got {self.n!r}")

    def should_save(self, context: SaveContext) -> bool:
        if context.last_save_step is None:
            return context.step % self.n == 0
        return context.step - context.last_save_step >= self.n or context.step % self.n == 0


@dataclass(frozen=True)
class EverySeconds:
    """Save when at least ``seconds`` of training time passed since the last save."""

    seconds: float

    def __post_init__(self) -> None:
        _positive(self.seconds, "EverySeconds.seconds")

    def should_save(self, context: SaveContext) -> bool:
        since = context.train_time - (context.last_save_train_time or 0.0)
        return since >= self.seconds


class AnyOf:
    """Save when any of the policies says so."""

    def __init__(self, *policies: SavePolicy) -> None:
        if not policies:
            raise ValueError("AnyOf(...) needs at least one policy")
        self.policies: tuple[SavePolicy, ...] = policies

    def should_save(self, context: SaveContext) -> bool:
        # evaluate all, so stateful policies observe every step
        return any([p.should_save(context) for p in self.policies])

    def __repr__(self) -> str:
        return f"AnyOf{self.policies!r}"


class AllOf:
    """Save only when all of the policies agree."""

    def __init__(self, *policies: SavePolicy) -> None:
        if not policies:
            raise ValueError("AllOf(...) needs at least one policy")
        self.policies: tuple[SavePolicy, ...] = policies

    def should_save(self, context: SaveContext) -> bool:
        return all([p.should_save(context) for p in self.policies])

    def __repr__(self) -> str:
        return f"AllOf{self.policies!r}"
