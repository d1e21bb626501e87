"""The JSON-lines event log between a supervised trainer and the supervisor that kills it.

The trainer appends one JSON object a line (its ``pid``, the wall time ``t``, the ``event`` and its
fields), line-buffered, so the supervisor sees each event at once. A SIGKILL can tear the last line;
readers skip it. Events: ``start`` (``resumed_from``: the restored step or None, ``spawned``,
``recovery_s``, ``restore_s``), ``step`` (``step``, ``loss``), ``committed`` (``step``, ``stall``,
``setup``: the part of the stall that allocated staging once, ``persist``, ``stored_bytes``,
``raw_bytes``) and ``done`` (``step``, and what the trainer adds).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["Event", "EventLog", "EventTail", "lost_steps", "of_kind"]

Event = dict[str, Any]


class EventLog:
    """The trainer's side: append events to ``path`` (created if missing), one line each."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - line-buffered for the supervisor

    def emit(self, event: str, **fields: Any) -> None:
        """Append ``event`` with ``fields``, stamped with this process's pid and the wall time."""
        self._file.write(json.dumps({"pid": os.getpid(), "t": time.time(), "event": event, **fields}) + "\n")

    def close(self) -> None:
        self._file.close()


class EventTail:
    """The supervisor's side: the events appended to ``path`` since the last :meth:`read`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        path.touch()

    def read(self) -> list[Event]:
        """The new complete lines as events; a line still being written waits for its end."""
        with self.path.open("rb") as handle:
            handle.seek(self._offset)
            chunk = handle.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        events = []
        for line in complete.splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # the line a kill tore
        return events

    def end_torn_line(self) -> None:
        """After a kill: end the line the dead writer may have left half-written."""
        with self.path.open("ab") as handle:
            handle.write(b"\n")


def of_kind(events: Sequence[Event], kind: str) -> list[Event]:
    """The events of one kind (``"start"``, ``"step"``, ...), in log order."""
    return [e for e in events if e["event"] == kind]


def lost_steps(events: Sequence[Event]) -> int:
    """Steps trained but not committed before a kill, so trained again after the restart.

    For each restart: the newest step the killed process reached, minus the step the restart resumed
    from. A process killed before it logged ``start`` trained nothing, so loses nothing.
    """
    lost, reached, first = 0, 0, True
    for e in events:
        if e["event"] == "step":
            reached = max(reached, e["step"])
        elif e["event"] == "start":
            resumed = e["resumed_from"] or 0
            if not first:
                lost += max(0, reached - resumed)
            reached, first = resumed, False
    return lost
