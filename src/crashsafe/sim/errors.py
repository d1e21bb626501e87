"""Errors of the failure simulator."""

from __future__ import annotations

from crashsafe.errors import CrashsafeError

__all__ = ["SimulationError"]


class SimulationError(CrashsafeError, ValueError):
    """The simulation was given an impossible profile, curve, failure trace or end rule."""
