"""Calls to actors that may be dead: one place that tells a lost server or worker from a real error.

A server killed mid-run, a worker Ray is relaunching and a standby still rebuilding its shard all
answer with :data:`LOST` here; the caller turns that into its recovery path. Any other error is
raised. Imported by the driver and the workers only, so ``import crashsafe.ps`` stays free of Ray.
"""

from __future__ import annotations

import enum
import time
from typing import Any, Final

import ray
from ray.exceptions import RayActorError

from crashsafe.ps.errors import ServerRecoveringError

__all__ = ["LOST", "get_or_lost", "server_unavailable", "wait_dead", "wait_relaunched"]

_RESTART_TIMEOUT = 120.0


class _Lost(enum.Enum):
    LOST = "lost"


LOST: Final = _Lost.LOST
"""What :func:`get_or_lost` returns when the actor answering the call was dead or rebuilding."""


def server_unavailable(exc: BaseException) -> bool:
    """True for the errors a dead, restarting or rebuilding server (or worker) produces."""
    return isinstance(exc, (RayActorError, ServerRecoveringError))


def get_or_lost(ref: Any, timeout: float | None = None) -> Any:
    """``ray.get(ref)``, or :data:`LOST` if the actor on the other end was dead or rebuilding."""
    try:
        return ray.get(ref, timeout=timeout)
    except Exception as exc:
        if not server_unavailable(exc):
            raise
        return LOST


def wait_dead(actor: Any) -> None:
    """Block until calls to the killed ``actor`` fail (Ray notices within milliseconds)."""
    deadline = time.monotonic() + _RESTART_TIMEOUT
    while time.monotonic() < deadline:
        if get_or_lost(actor.status.remote(), timeout=_RESTART_TIMEOUT) is LOST:
            return
        time.sleep(0.005)
    raise TimeoutError(f"a killed server still answered after {_RESTART_TIMEOUT:.0f} s")


def wait_relaunched(actor: Any, old_pid: int | None) -> None:
    """Block until worker ``actor`` answers again (from a new process if ``old_pid`` is given)."""
    deadline = time.monotonic() + _RESTART_TIMEOUT
    while True:
        pid = get_or_lost(actor.pid.remote(), timeout=_RESTART_TIMEOUT)
        if pid is not LOST and (old_pid is None or pid != old_pid):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"actor did not come back within {_RESTART_TIMEOUT:.0f} s after a failure")
        time.sleep(0.02)
