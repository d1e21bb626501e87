"""Save policies (when to checkpoint) and retention (what to keep)."""

from crashsafe.policies.base import All, Any, EverySeconds, EverySteps, SaveContext, SavePolicy

__all__ = ["All", "Any", "EverySeconds", "EverySteps", "SaveContext", "SavePolicy"]
