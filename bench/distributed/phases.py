"""Where a crashsafe distributed save spends its time: timers wrapped around the library's phases.

The benchmark's evidence for a missed target. The wrapped functions are crashsafe internals, named
here; one that no longer exists is skipped (and reported missing), never an error.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections import defaultdict
from typing import Any

# (module, owner or "", function): the phase's name in the report
PHASES: dict[tuple[str, str, str], str] = {
    ("crashsafe.saving", "", "flatten"): "stall: of which walking the state (state_dict, optimizer)",
    ("crashsafe.state.staging", "StagingPool", "capture"): "stall: of which the copy into staging",
    (
        "crashsafe.distributed.saving",
        "ReplicaPlanner",
        "plan",
    ): "planning (describe, hash what ranks hold alike, exchange): DDP in the stall, FSDP2 after it",
    (
        "crashsafe.distributed.group",
        "Coordinator",
        "all_gather",
    ): "all_gather offers (in the stall) + reports (waits for the slowest rank)",
    (
        "crashsafe.distributed.saving",
        "",
        "_write_part",
    ): "write this rank's part (encode, write, checksum, fsync)",
    ("crashsafe.storage.writer", "StepWriter", "write_payload"): "  of which write + checksum of payloads",
    ("crashsafe.storage.writer", "StepWriter", "persist"): "  of which fsync of the part",
    ("crashsafe.distributed.group", "Coordinator", "agree"): "commit on rank 0 + broadcast of its outcome",
    ("crashsafe.storage.writer", "StepWriter", "commit"): "  of which manifest + rename + fsync (rank 0)",
    (
        "crashsafe.manager",
        "CheckpointManager",
        "_retain",
    ): "  of which retention: delete the older step (rank 0)",
}

totals: dict[str, float] = defaultdict(float)
missing: list[str] = []


def install(table: dict[tuple[str, str, str], str] | None = None) -> None:
    """Wrap every phase's function (of ``table``, else :data:`PHASES`) with a timer that adds into
    :data:`totals`."""
    for (module_name, owner_name, name), label in (PHASES if table is None else table).items():
        module = importlib.import_module(module_name)
        owner: Any = getattr(module, owner_name) if owner_name else module
        fn = getattr(owner, name, None)
        if fn is None:
            missing.append(f"{module_name}.{owner_name + '.' if owner_name else ''}{name}")
            continue
        setattr(owner, name, _timed(fn, label))


def _timed(fn: Any, label: str) -> Any:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - began

    return timed


def take() -> dict[str, float]:
    """The phases' times since the last take (seconds), and reset."""
    out = dict(totals)
    totals.clear()
    return out
