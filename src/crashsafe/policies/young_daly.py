"""Young's and Daly's optimum checkpoint intervals, and policies that apply them to the measured cost.

Notation (seconds): ``cost`` δ = checkpoint cost, ``mtbf`` M = mean time between failures, ``restart``
R = time to restart after a failure; the interval τ is *compute* time between checkpoints.

- Young (1974): τ = √(2δM).
- Daly (FGCS 2006) higher-order: τ = √(2δM)·[1 + ⅓√(δ/2M) + (δ/2M)/9] − δ for δ < 2M, else M.
- Daly exact optimum of his complete model: τ = M·[1 + W₀(−e^{−(1+δ/M)})] (Lambert W, principal branch).
  R does not move the optimum of that model (it only scales the expected wall time).
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from crashsafe.policies.base import SaveContext
from crashsafe.policies.errors import PolicyError
from crashsafe.policies.measured import CostClock, check_mtbf
from crashsafe.policies.units import parse_duration

__all__ = ["Daly", "Young", "daly_interval", "daly_wall_time", "young_interval"]


def _check(cost: float, mtbf: float) -> None:
    if not (cost >= 0 and math.isfinite(cost)):
        raise PolicyError(f"checkpoint cost must be a finite number >= 0 seconds, got {cost!r}")
    if not mtbf > 0:
        raise PolicyError(f"mtbf must be positive, got {mtbf!r}")


def young_interval(cost: float, mtbf: float) -> float:
    """Young's optimum compute time between checkpoints, √(2·cost·mtbf)."""
    _check(cost, mtbf)
    return math.sqrt(2.0 * cost * mtbf)


def daly_interval(cost: float, mtbf: float, exact: bool = False) -> float:
    """Daly's optimum: the higher-order series, or (``exact``) the Lambert-W minimiser of his model."""
    _check(cost, mtbf)
    return _daly(float(cost), float(mtbf), bool(exact))


@functools.lru_cache(maxsize=1024)  # policies ask at every step, with a cost that rarely changes
def _daly(cost: float, mtbf: float, exact: bool) -> float:
    if math.isinf(mtbf):
        return math.inf
    if exact:
        from scipy.special import lambertw

        w = lambertw(-math.exp(-(1.0 + cost / mtbf)), 0)
        return max(0.0, float(mtbf * (1.0 + w.real)))
    if cost >= 2.0 * mtbf:
        return mtbf
    ratio = cost / (2.0 * mtbf)
    return math.sqrt(2.0 * cost * mtbf) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost


def daly_wall_time(
    solve_time: float, interval: float, cost: float, mtbf: float, restart: float = 0.0
) -> float:
    """Expected wall time of Daly's complete model, M·e^{R/M}·(e^{(τ+δ)/M} − 1)·T_s/τ.

    Failures are Poisson and may strike during compute, checkpoint and restart alike.
    """
    _check(cost, mtbf)
    if interval <= 0 or solve_time < 0:
        raise PolicyError(f"interval must be > 0 and solve_time >= 0, got {interval!r}, {solve_time!r}")
    if math.isinf(mtbf):
        return solve_time * (interval + cost) / interval
    return mtbf * math.exp(restart / mtbf) * math.expm1((interval + cost) / mtbf) * solve_time / interval


class _IntervalPolicy(ABC):
    """Save when the compute time since the last save reaches ``interval(measured cost)``.

    Until a cost is known, one profiling save measures it (and no other save happens while it persists).
    """

    def __init__(
        self, mtbf: float | str, cost: float | str | None, include_persist: bool, profile_step: int
    ) -> None:
        self.mtbf = check_mtbf(mtbf)
        self.clock = CostClock(cost, include_persist, profile_step)
        self.last_interval: float | None = None

    @abstractmethod
    def interval(self, cost: float) -> float:
        """Compute seconds between checkpoints for a checkpoint cost of ``cost`` seconds."""

    def should_save(self, context: SaveContext) -> bool:
        now = self.clock.observe(context)
        if math.isinf(self.mtbf):
            return False
        cost = self.clock.cost()
        if cost is None:
            return self.clock.profile_due(context)
        self.last_interval = self.interval(cost)
        return now - self.clock.last_save(context) >= self.last_interval

    def state_dict(self) -> dict[str, Any]:
        """Clock and measured cost, so a restored job keeps its schedule (put the policy in the state)."""
        return self.clock.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.clock.load_state_dict(state)


class Young(_IntervalPolicy):
    """Checkpoint every √(2·cost·mtbf) seconds of training, with the cost measured by the manager.

    Args:
        mtbf: mean time between failures (seconds or ``"4h"``).
        cost: fixed checkpoint cost; default None uses the manager's measured stall (mean of recent saves).
        include_persist: add the background persist time to the cost (use for synchronous saves).
        profile_step: with no cost known yet, save once this many steps in to measure it.
    """

    def __init__(
        self,
        mtbf: float | str,
        *,
        cost: float | str | None = None,
        include_persist: bool = False,
        profile_step: int = 10,
    ) -> None:
        super().__init__(mtbf, cost, include_persist, profile_step)

    def interval(self, cost: float) -> float:
        return young_interval(cost, self.mtbf)

    def __repr__(self) -> str:
        return f"Young(mtbf={self.mtbf:g})"


class Daly(_IntervalPolicy):
    """Daly's optimum interval (higher-order series, or the exact Lambert-W optimum with ``exact=True``).

    ``restart`` (seconds) enters :meth:`expected_wall_time` only: Daly's optimum does not depend on it.
    Other arguments as for :class:`Young`.
    """

    def __init__(
        self,
        mtbf: float | str,
        *,
        restart: float | str = 0.0,
        exact: bool = False,
        cost: float | str | None = None,
        include_persist: bool = False,
        profile_step: int = 10,
    ) -> None:
        super().__init__(mtbf, cost, include_persist, profile_step)
        self.restart = parse_duration(restart, "restart")
        self.exact = bool(exact)

    def interval(self, cost: float) -> float:
        return daly_interval(cost, self.mtbf, self.exact)

    def expected_wall_time(self, solve_time: float, cost: float) -> float:
        """Daly's expected wall time to finish ``solve_time`` seconds of work at this policy's interval."""
        return daly_wall_time(solve_time, self.interval(cost), cost, self.mtbf, self.restart)

    def __repr__(self) -> str:
        return f"Daly(mtbf={self.mtbf:g}, restart={self.restart:g}, exact={self.exact})"
