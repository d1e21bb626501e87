"""Failure simulator: replays save policies on a training profile under Monte Carlo failures."""

from crashsafe.sim.curve import LossCurve
from crashsafe.sim.endrules import EndRule, FixedSteps, Plateau, TargetLoss
from crashsafe.sim.engine import Outcomes, run_trials
from crashsafe.sim.errors import SimulationError
from crashsafe.sim.failures import Exponential, FailureModel, Trace, Weibull
from crashsafe.sim.hindsight import Hindsight
from crashsafe.sim.profile import Profile
from crashsafe.sim.replay import Schedule, replay
from crashsafe.sim.result import METRICS, Estimate, SimResult, paired_ratio
from crashsafe.sim.simulate import compare, simulate, simulate_schedule

__all__ = [
    "METRICS",
    "EndRule",
    "Estimate",
    "Exponential",
    "FailureModel",
    "FixedSteps",
    "Hindsight",
    "LossCurve",
    "Outcomes",
    "Plateau",
    "Profile",
    "Schedule",
    "SimResult",
    "SimulationError",
    "TargetLoss",
    "Trace",
    "Weibull",
    "compare",
    "paired_ratio",
    "replay",
    "run_trials",
    "simulate",
    "simulate_schedule",
]
