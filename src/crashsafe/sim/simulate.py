"""Replay policies against a training profile under simulated failures."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from crashsafe.policies.base import SavePolicy
from crashsafe.sim.endrules import EndRule, FixedSteps
from crashsafe.sim.engine import run_trials
from crashsafe.sim.errors import SimulationError
from crashsafe.sim.failures import FailureModel
from crashsafe.sim.profile import Profile
from crashsafe.sim.replay import replay
from crashsafe.sim.result import SimResult

__all__ = ["compare", "simulate", "simulate_schedule"]


def simulate(
    policy: SavePolicy,
    profile: Profile,
    failures: FailureModel,
    end: EndRule | None = None,
    *,
    trials: int = 1000,
    seed: int = 0,
    name: str | None = None,
) -> SimResult:
    """Replay ``policy`` on ``profile`` and run ``trials`` seeded failure trials."""
    end_step = (end or FixedSteps()).end_step(profile.curve)
    schedule = replay(policy, profile, end_step)
    return simulate_schedule(
        schedule.steps, profile, failures, end_step, trials=trials, seed=seed,
        name=name or repr(policy), stalls=schedule.stalls, notes=tuple(schedule.notes),
    )


def simulate_schedule(
    steps: np.ndarray,
    profile: Profile,
    failures: FailureModel,
    end_step: int,
    *,
    trials: int = 1000,
    seed: int = 0,
    name: str = "schedule",
    stalls: np.ndarray | None = None,
    notes: tuple[str, ...] = (),
) -> SimResult:
    """Run trials for checkpoints at the given ``steps`` (each stalling ``profile.stall`` by default)."""
    if trials < 1:
        raise SimulationError(f"trials must be >= 1, got {trials}")
    steps = np.asarray(steps, dtype=np.int64)
    if np.any(np.diff(steps) <= 0) or (steps.size and (steps[0] < 1 or steps[-1] >= end_step)):
        raise SimulationError("checkpoint steps must increase strictly and lie in [1, end_step)")
    stalls = np.full(steps.size, profile.stall) if stalls is None else np.asarray(stalls, dtype=np.float64)
    busy = end_step * profile.step_time + sum(stalls.tolist()) + profile.persist + profile.restart
    if not math.isfinite(busy):  # (a float overflows past 1.8e308 s: "--ckpt-cost 1e308s")
        raise SimulationError(
            "the job's failure-free time (training, every checkpoint's stall, persist and restart) is too "
            "large to simulate; give durations a run can have, e.g. --ckpt-cost 30s --job 24h"
        )
    outcomes = run_trials(
        steps * profile.step_time, stalls, end_step * profile.step_time, profile.persist, profile.restart,
        profile.curve, profile.step_time, failures, trials, seed,
    )
    return SimResult(name, steps, end_step, outcomes, notes)


def compare(
    policies: Mapping[str, SavePolicy],
    profile: Profile,
    failures: FailureModel,
    end: EndRule | None = None,
    *,
    trials: int = 1000,
    seed: int = 0,
) -> list[SimResult]:
    """:func:`simulate` each named policy with the same seed, so they meet the same failures."""
    return [
        simulate(policy, profile, failures, end, trials=trials, seed=seed, name=name)
        for name, policy in policies.items()
    ]
