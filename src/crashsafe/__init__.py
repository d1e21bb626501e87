"""crashsafe: crash-consistent, verified, compressed checkpoints for machine-learning training.

>>> import crashsafe as cs
>>> mgr = cs.CheckpointManager("ckpt", keep_last=3)           # doctest: +SKIP
>>> mgr.save(step, {"model": model, "optim": optim, "rng": cs.RNGState()})  # doctest: +SKIP
"""

from crashsafe import codecs, policies, sim
from crashsafe.errors import (
    CheckpointExistsError,
    CodecError,
    CorruptCheckpointError,
    CorruptCheckpointWarning,
    CrashsafeError,
    DiskFullError,
    LockedError,
    NoCheckpointError,
    SaveFailedError,
    StorageError,
    UnsupportedStateError,
)
from crashsafe.manager import CheckpointManager, SaveStats
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
from crashsafe.verify import StepReport, VerifyReport, verify

__version__ = "0.1.0"

__all__ = [
    "CheckpointExistsError",
    "CheckpointManager",
    "CodecError",
    "CorruptCheckpointError",
    "CorruptCheckpointWarning",
    "CorruptShelfError",
    "CrashsafeError",
    "DiskFullError",
    "LockedError",
    "NoCheckpointError",
    "NotAShelfError",
    "RNGState",
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
