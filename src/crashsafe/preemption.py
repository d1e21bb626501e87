"""SIGTERM as a preemption notice: remembered, so the training loop can save once more and exit.

Cluster schedulers send SIGTERM some seconds before they kill a job. With ``save_on_sigterm=True``
the manager notes the signal instead of dying at once; its next ``save``/``maybe_save`` commits a
final checkpoint and exits with status 143 (128 + SIGTERM).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from types import FrameType
from typing import Any

from crashsafe.errors import CrashsafeError

__all__ = ["EXIT_STATUS", "SigtermWatch"]

EXIT_STATUS = 128 + signal.SIGTERM


class SigtermWatch:
    """Notes SIGTERM while it is installed; ``close()`` puts the previous handler back."""

    def __init__(self, install: bool) -> None:
        self._arrived = threading.Event()
        self._previous: Any = None
        if install:
            if threading.current_thread() is not threading.main_thread():
                raise CrashsafeError("save_on_sigterm=True must be set up from the main thread")
            self._previous = signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self._arrived.set()

    @property
    def arrived(self) -> bool:
        """True once SIGTERM arrived."""
        return self._arrived.is_set()

    def close(self) -> None:
        if self._previous is not None:
            with contextlib.suppress(ValueError):  # not the main thread any more: leave it
                signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
