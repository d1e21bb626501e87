"""Policies by name, for the command line and the benchmarks: ``young``, ``daly``, ``coci``, ..."""

from __future__ import annotations

from typing import Any

from crashsafe.policies.base import EverySeconds, EverySteps, SavePolicy
from crashsafe.policies.coci import ConvergenceAware
from crashsafe.policies.errors import PolicyError
from crashsafe.policies.overhead import MaxOverhead
from crashsafe.policies.units import parse_duration
from crashsafe.policies.young_daly import Daly, Young

__all__ = ["POLICY_NAMES", "policy_from_name"]

POLICY_NAMES = {
    "young": "Young: √(2·cost·MTBF)",
    "daly": "Daly: higher-order series",
    "daly-exact": "Daly: exact optimum (Lambert W)",
    "coci": "COCI's published convergence-aware schedule",
    "convergence": "convergence-aware, minimises expected lost value (ConvergenceAware default)",
    "every:N": "every N steps",
    "seconds:S": "every S seconds of training",
    "overhead:F": "CheckFreq cap: stalls at most the fraction F of training time",
}


def policy_from_name(
    name: str, *, mtbf: float | str, restart: float | str = 0.0, cost: float | str | None = None,
    **convergence: Any,
) -> SavePolicy:
    """A fresh policy for ``name`` (see :data:`POLICY_NAMES`); ``convergence`` goes to ConvergenceAware."""
    key, _, arg = name.strip().lower().partition(":")
    try:
        if key == "young":
            return Young(mtbf, cost=cost)
        if key == "daly":
            return Daly(mtbf, restart=restart, cost=cost)
        if key == "daly-exact":
            return Daly(mtbf, restart=restart, cost=cost, exact=True)
        if key == "coci":  # as published, with COCI's refit period of 10,000 iterations
            options = {"refit_every": 10_000, **convergence}
            return ConvergenceAware(mtbf, schedule="coci", cost=cost, **options)
        if key == "convergence":
            return ConvergenceAware(mtbf, schedule="value", cost=cost, **convergence)
        if key == "every":
            return EverySteps(int(arg))
        if key == "seconds":
            return EverySeconds(parse_duration(arg, "seconds"))
        if key == "overhead":
            return MaxOverhead(float(arg), cost=cost)
    except ValueError as exc:
        if isinstance(exc, PolicyError):
            raise
        raise PolicyError(f"policy {name!r}: {exc}") from None
    raise PolicyError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
