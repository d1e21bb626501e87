"""Save policies (when to checkpoint) and keep policies (what retention keeps)."""


from crashsafe._log import warn
from crashsafe.policies.base import AllOf, AnyOf, EverySeconds, EverySteps, SaveContext, SavePolicy
from crashsafe.policies.coci import ConvergenceAware, coci_protected_loss, coci_schedule, value_factor
from crashsafe.policies.errors import FitError, PolicyError, PolicyWarning
from crashsafe.policies.fitting import ExpFit, fit_exponential
from crashsafe.policies.keep import (
    KeepBest,
    KeepEvery,
    KeepEveryInterval,
    KeepLast,
    KeepPolicy,
    KeepUnion,
    StepFacts,
)
from crashsafe.policies.names import POLICY_NAMES, policy_from_name
from crashsafe.policies.overhead import MaxOverhead
from crashsafe.policies.units import parse_duration
from crashsafe.policies.young_daly import Daly, Young, daly_interval, daly_wall_time, young_interval

__all__ = [
    "POLICY_NAMES",
    "AllOf",
    "AnyOf",
    "ConvergenceAware",
    "Daly",
    "EverySeconds",
    "EverySteps",
    "ExpFit",
    "FitError",
    "KeepBest",
    "KeepEvery",
    "KeepEveryInterval",
    "KeepLast",
    "KeepPolicy",
    "KeepUnion",
    "MaxOverhead",
    "PolicyError",
    "PolicyWarning",
    "SaveContext",
    "SavePolicy",
    "StepFacts",
    "Young",
    "coci_protected_loss",
    "coci_schedule",
    "daly_interval",
    "daly_wall_time",
    "fit_exponential",
    "parse_duration",
    "policy_from_name",
    "value_factor",
    "young_interval",
]


_RENAMED = {"Any": AnyOf, "All": AllOf}  # old names (they shadowed typing.Any), kept for one release


def __getattr__(name: str) -> type:
    if name in _RENAMED:
        new = _RENAMED[name]
        warn(
            f"crashsafe.policies.{name} is now {new.__name__}; the old name goes in the next release",
            DeprecationWarning,
        )
        return new
    raise AttributeError(f"module 'crashsafe.policies' has no attribute {name!r}")
