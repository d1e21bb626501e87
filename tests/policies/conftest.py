"""A stand-in for the manager: feeds a policy the contexts a training run would produce."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from crashsafe.policies import SaveContext, SavePolicy


class Driver:
    """Steps of ``dt`` training seconds; each save stalls ``stall`` seconds, measured at once."""

    def __init__(self, policy: SavePolicy, dt: float, stall: float | None = 1.0, start_step: int = 0) -> None:
        self.policy, self.dt, self.stall = policy, dt, stall
        self.step, self.time = start_step, 0.0
        self.saves: list[int] = []
        self.last: tuple[int, float] | None = None

    def run(self, steps: int, loss: Callable[[float], float] = lambda t: 1.0) -> list[int]:
        """Advance ``steps`` steps; return the steps at which the policy saved."""
        saved = []
        for _ in range(steps):
            self.step += 1
            self.time += self.dt
            context = SaveContext(
                step=self.step, train_time=self.time,
                last_save_step=self.last[0] if self.last else None,
                last_save_train_time=self.last[1] if self.last else None,
                stall=self.stall if self.last else None, persist=0.0 if self.last else None,
                saves=len(self.saves), metrics={"loss": loss(self.time)},
            )
            if self.policy.should_save(context):
                self.last = (self.step, self.time)
                self.saves.append(self.step)
                saved.append(self.step)
        return saved


@pytest.fixture
def driver() -> Callable[..., Driver]:
    return Driver
