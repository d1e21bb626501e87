"""Parameter server on Ray with FreeLauncher-style lossless recovery (see docs/ps.md).

>>> from crashsafe.ps import Failure, PSConfig, PSJob          # doctest: +SKIP
>>> with PSJob(PSConfig(workload="sparse_lr", replicas=2, clocks=60)) as job:  # doctest: +SKIP
...     result = job.run([Failure(clock=30, servers=(0,))])
>>> result.updates_lost, result.recomputed_clocks              # doctest: +SKIP
(0, 0)
"""

from crashsafe.ps.cluster import connect, local_ray
from crashsafe.ps.config import Failure, PSConfig
from crashsafe.ps.driver import PSJob
from crashsafe.ps.errors import DataLossError, DataLossWarning, PSConfigError, PSError, ServerRecoveringError
from crashsafe.ps.result import Recovery, RunResult

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
]
