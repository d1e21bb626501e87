"""Parameter server on Ray with FreeLauncher-style lossless recovery (see docs/ps.md).

>>> from crashsafe.ps import Failure, PSConfig, PSJob          # doctest: +SKIP
>>> with PSJob(PSConfig(workload="sparse_lr", replicas=2, clocks=60)) as job:  # doctest: +SKIP
...     result = job.run([Failure(clock=30, servers=(0,))])
>>> result.updates_lost, result.recomputed_clocks              # doctest: +SKIP
(0, 0)

``PSJob`` is imported on first use: it brings in Ray, and ``import crashsafe.ps`` (configs,
results, errors) does not need it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from crashsafe.ps.cluster import connect, local_ray, ray_messages_to
from crashsafe.ps.config import Failure, PSConfig
from crashsafe.ps.errors import DataLossError, DataLossWarning, PSConfigError, PSError, ServerRecoveringError
from crashsafe.ps.result import Recovery, RunResult

if TYPE_CHECKING:
    from crashsafe.ps.driver import PSJob

__all__ = [
    "DataLossError",
    "DataLossWarning",
    "Failure",
    "PSConfig",
    "PSConfigError",
    "PSError",
    "PSJob",
    "Recovery",
    "RunResult",
    "ServerRecoveringError",
    "connect",
    "local_ray",
    "ray_messages_to",
]


def __getattr__(name: str) -> Any:
    """``PSJob`` (and with it Ray) is imported on first use."""
    if name == "PSJob":
        from crashsafe.ps.driver import PSJob

        return PSJob
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
