"""Replay a policy over the failure-free run to get its checkpoint steps.

The policy sees what the manager would give it at each step: training time, the loss, and the
measured cost of past saves once they finished persisting. Schedules are indexed by training
progress: a job restored from step s replays the same decisions after s (the policy's clock and
fit travel in the checkpoint, see ``ConvergenceAware.state_dict``).
"""

from __future__ import annotations

import copy
import warnings

import numpy as np

from crashsafe.policies.base import SaveContext, SavePolicy
from crashsafe.sim.profile import Profile

__all__ = ["Schedule", "replay"]


class Schedule:
    """Checkpoint steps of one policy, their stalls (incl. waiting for the previous persist), and the
    warnings the policy issued while replayed."""

    def __init__(self, steps: np.ndarray, stalls: np.ndarray, notes: list[str]) -> None:
        self.steps, self.stalls, self.notes = steps, stalls, notes


def replay(policy: SavePolicy, profile: Profile, end_step: int) -> Schedule:
    """Steps (< ``end_step``) at which a copy of ``policy`` saves in the failure-free run."""
    policy = copy.deepcopy(policy)
    dt, losses = profile.step_time, profile.curve.losses
    saves: list[int] = []
    stalls: list[float] = []
    visible: list[float] = []  # stalls of saves whose persist finished (the manager's stats)
    persisted_at = -1.0  # training time at which the newest save finishes persisting
    last_time: float | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, end_step):
            now = step * dt
            if saves and len(visible) < len(saves) and now >= persisted_at:
                visible.append(stalls[-1])
            recent = visible[-5:]
            context = SaveContext(
                step=step,
                train_time=now,
                last_save_step=saves[-1] if saves else None,
                last_save_train_time=last_time,
                stall=sum(recent) / len(recent) if recent else None,
                persist=profile.persist if recent else None,
                saves=len(visible),
                metrics={"loss": float(losses[step - 1])},
            )
            if not policy.should_save(context):
                continue
            wait = max(0.0, persisted_at - now) if saves else 0.0
            if saves and len(visible) < len(saves):
                visible.append(stalls[-1])  # saving harvests the previous save's stats
            saves.append(step)
            stalls.append(profile.stall + wait)
            last_time = now
            persisted_at = now + profile.persist
    notes = sorted({str(w.message) for w in caught})
    return Schedule(np.asarray(saves, dtype=np.int64), np.asarray(stalls, dtype=np.float64), notes)
