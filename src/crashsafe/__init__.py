"""crashsafe: crash-consistent, verified, compressed checkpoints for machine-learning training.

>>> import crashsafe as cs
>>> mgr = cs.CheckpointManager("ckpt", keep_last=3)           # doctest: +SKIP
>>> mgr.save(step, {"model": model, "optim": optim, "rng": cs.RNGState()})  # doctest: +SKIP
"""

from typing import Any

from crashsafe import codecs, policies
from crashsafe.errors import (
    CheckpointExistsError,
    CodecError,
    CoordinationError,
    CorruptCheckpointError,
    CorruptCheckpointWarning,
    CrashsafeError,
    CrashsafeWarning,
    DiskFullError,
    InvalidArgumentError,
    LockedError,
    MirrorWarning,
    NoCheckpointError,
    RetentionWarning,
    SaveFailedError,
    StorageError,
    UnsupportedStateError,
)
from crashsafe.manager import CheckpointManager, SaveStats
from crashsafe.memory_tier import MemoryTier
from crashsafe.recovery import Recovery
from crashsafe.shelf import (
    CorruptShelfError,
    NotAShelfError,
    Shelf,
    ShelfError,
    ShelfFullError,
    ShelfRecoveredWarning,
)
from crashsafe.state.rng import RNGState
from crashsafe.state.tree import Stateful
from crashsafe.verification import StepReport, VerifyReport, verify

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``cs.sim`` (the failure simulator) is imported on first use: training jobs never need it."""
    if name == "sim":
        import importlib

        return importlib.import_module("crashsafe.sim")
    raise AttributeError(f"module 'crashsafe' has no attribute {name!r}")


__all__ = [
    "CheckpointExistsError",
    "CheckpointManager",
    "CodecError",
    "CoordinationError",
    "CorruptCheckpointError",
    "CorruptCheckpointWarning",
    "CorruptShelfError",
    "CrashsafeError",
    "CrashsafeWarning",
    "DiskFullError",
    "InvalidArgumentError",
    "LockedError",
    "MemoryTier",
    "MirrorWarning",
    "NoCheckpointError",
    "NotAShelfError",
    "RNGState",
    "Recovery",
    "RetentionWarning",
    "SaveFailedError",
    "SaveStats",
    "Shelf",
    "ShelfError",
    "ShelfFullError",
    "ShelfRecoveredWarning",
    "Stateful",
    "StepReport",
    "StorageError",
    "UnsupportedStateError",
    "VerifyReport",
    "__version__",
    "codecs",
    "policies",
    "sim",
    "verify",
]
