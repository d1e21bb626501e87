"""Errors and warnings of the save policies."""

from __future__ import annotations

from crashsafe.errors import CrashsafeError, CrashsafeWarning

__all__ = ["FitError", "PolicyError", "PolicyWarning"]


class PolicyError(CrashsafeError, ValueError):
    """A policy was configured with an impossible value (negative MTBF, unknown name, ...)."""


class FitError(PolicyError):
    """A loss curve could not be fitted; the caller falls back or asks for more samples."""


class PolicyWarning(CrashsafeWarning):
    """A policy switched to its documented fallback (e.g. the loss curve could not be fitted)."""
