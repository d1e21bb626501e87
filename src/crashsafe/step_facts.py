"""Committed steps' commit times and metrics, for the keep policies and ``best_step``.

Each step's facts come from its manifest, read on first use only: retention runs after every save,
so a caller passes a cache that keeps them across calls (as it does the delta bases).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, MutableMapping, Sequence

from crashsafe.errors import CorruptCheckpointError, NoCheckpointError
from crashsafe.format.manifest import MAX_STEP, Manifest
from crashsafe.policies.errors import PolicyError
from crashsafe.policies.keep import UNKNOWN, Facts, Mode, StepFacts, check_metric, check_mode, ranked
from crashsafe.storage.base import Store
from crashsafe.storage.reader import read_manifest

__all__ = ["StepSpec", "best_step", "facts_lookup", "pick_step"]

StepSpec = int | str | None  # a step number, None (the newest) or "best"


def _read(store: Store, step: int, seen: Callable[[int, Manifest], None] | None) -> StepFacts:
    """The facts in ``step``'s manifest; UNKNOWN if it is damaged or gone (it cannot be restored)."""
    try:
        manifest = read_manifest(store, step)
    except (CorruptCheckpointError, NoCheckpointError):
        return UNKNOWN
    if seen is not None:
        seen(step, manifest)
    return StepFacts(manifest.created, manifest.metrics)


def facts_lookup(
    store: Store,
    steps: Sequence[int],
    cache: MutableMapping[int, StepFacts] | None = None,
    seen: Callable[[int, Manifest], None] | None = None,
) -> Facts:
    """``facts(step)`` for the committed ``steps`` of ``store``, each manifest read once. ``cache``
    keeps them across calls; entries of steps no longer in ``steps`` are dropped first. ``seen`` gets
    each manifest read (so a caller can take what else it needs from it without reading it again)."""
    memo: MutableMapping[int, StepFacts] = {} if cache is None else cache
    for gone in memo.keys() - set(steps):
        del memo[gone]

    def facts(step: int) -> StepFacts:
        found = memo.get(step)
        if found is None:
            found = memo[step] = _read(store, step, seen)
        return found

    return facts


def best_step(
    stores: Sequence[Store], listed: Sequence[Sequence[int]], metric: str, mode: Mode
) -> int | None:
    """The step with the best finite ``metric`` among the ``listed`` steps of ``stores`` (a step in
    several, read from the first; ties: the newest); None when there is no step at all."""
    metric, mode = check_metric(metric, "best_step"), check_mode(mode, "best_step")
    holder: dict[int, int] = {}
    for at, steps in enumerate(listed):
        for step in steps:
            holder.setdefault(step, at)
    lookups = [
        facts_lookup(store, [s for s, at in holder.items() if at == i]) for i, store in enumerate(stores)
    ]

    def facts(step: int) -> StepFacts:
        return lookups[holder[step]](step)

    steps = sorted(holder)
    best = ranked(steps, facts, metric, mode)
    if best:
        return best[0]
    if not steps:
        return None
    recorded = sorted({name for step in steps for name in facts(step).metrics})
    raise NoCheckpointError(
        f"no committed step in {stores[0].location} records the metric {metric!r} as a finite number "
        f"(they record: {', '.join(map(repr, recorded)) or 'no metrics'}); pass a recorded metric, or "
        f"save with metrics={{{metric!r}: ...}}"
    )


def pick_step(
    step: StepSpec, metric: str | None, mode: Mode, best: Callable[[str, Mode], int | None]
) -> int | None:
    """``step`` (a step number, or None: the newest), or for ``step="best"`` the step ``best(metric,
    mode)`` picks (None when there is no step)."""
    if isinstance(step, str):
        if step != "best":
            raise PolicyError(f"step must be a step number, None (the newest) or 'best', got {step!r}")
        if metric is None:
            raise PolicyError(
                "step='best' needs metric=, e.g. restore(state, step='best', metric='val_loss')"
            )
        return best(metric, mode)
    if metric is not None:
        raise PolicyError(f"metric= picks the step for step='best' only, but step={step!r}; drop one of them")
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or not 0 <= step <= MAX_STEP:
        raise PolicyError(f"step must be an int in [0, 2**63 - 1], None (the newest) or 'best', got {step!r}")
    return int(step)
