"""Read a state back from a store: one step, or the newest intact one with fallback.

A damaged step (any :class:`CorruptCheckpointError` or :class:`StorageError` while reading it) is
skipped with a :class:`CorruptCheckpointWarning` naming the damage. A step that a writer deletes
while it is read is not damage: when every step tried vanished, the steps are listed afresh, so a
reader beside a writer always ends on a whole step.
"""

from __future__ import annotations

import warnings
from typing import Any

from crashsafe.chain import read_step
from crashsafe.errors import (
    CorruptCheckpointError,
    CorruptCheckpointWarning,
    CrashsafeError,
    NoCheckpointError,
    StorageError,
)
from crashsafe.state.rebuild import to_value, unflatten
from crashsafe.storage.base import Store
from crashsafe.storage.oserror import storage_error

__all__ = ["READ_ATTEMPTS", "newest_intact", "read_state"]

READ_ATTEMPTS = 5  # listings tried when every step tried vanished


def read_state(store: Store, step: int, numpy: bool) -> dict[str, Any]:
    """The state saved as ``step``: tensors (or numpy arrays), arrays and python values, verified."""
    try:
        manifest, arrays = read_step(store, step)
    except OSError as exc:
        if isinstance(exc, CrashsafeError):
            raise
        raise storage_error(exc, f"reading step {step} from {store.location}") from None
    values = [to_value(e.kind, e.dtype, a, numpy) for e, a in zip(manifest.payloads, arrays, strict=True)]
    state = unflatten(manifest.tree, values)
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"step {step}: the saved state is not a dict")
    return state


def newest_intact(store: Store, numpy: bool, stacklevel: int = 2) -> tuple[int, dict[str, Any]] | None:
    """(step, state) of the newest step that reads back intact, or None if there is no step."""
    damage: dict[int, str] = {}
    for _ in range(READ_ATTEMPTS):
        steps = store.steps()
        if not steps:
            return None
        vanished = False
        for candidate in reversed(steps):
            if candidate in damage:
                continue
            try:
                return candidate, read_state(store, candidate, numpy)
            except (CorruptCheckpointError, StorageError) as exc:
                damage[candidate] = str(exc)
                warnings.warn(
                    f"skipping damaged checkpoint: {exc}. Falling back to an older step.",
                    CorruptCheckpointWarning,
                    stacklevel=stacklevel + 1,
                )
            except NoCheckpointError:
                vanished = True  # deleted by the writer's retention while we read it
        if not vanished:
            break
    if not damage:
        raise NoCheckpointError(
            f"every step of {store.location} was deleted while it was read, {READ_ATTEMPTS} times over; "
            "another process is deleting steps. Try again"
        )
    raise CorruptCheckpointError(
        f"every checkpoint in {store.location} is damaged: "
        + "; ".join(damage[s] for s in sorted(damage, reverse=True))
        + ". Run `crashsafe verify` for details."
    )
