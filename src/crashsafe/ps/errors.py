"""Errors of the parameter server; each names the problem and what to do next."""

from __future__ import annotations

from crashsafe.errors import CrashsafeError, CrashsafeWarning

__all__ = ["DataLossError", "DataLossWarning", "PSConfigError", "PSError", "ServerRecoveringError"]


class PSError(CrashsafeError, RuntimeError):
    """Base class of the parameter server's errors."""


class PSConfigError(PSError, ValueError):
    """A parameter-server setting is out of range or inconsistent with another."""


class ServerRecoveringError(PSError):
    """A relaunched server refuses pulls and pushes until it has rebuilt its shard."""


class DataLossError(PSError):
    """More copies failed than the replication factor tolerates and no checkpoint can cover it."""


class DataLossWarning(CrashsafeWarning):
    """More copies failed than the replication factor tolerates; the job rolled back to a checkpoint."""
