"""The save in flight: at most one, persisted on a background thread (or in the caller, for saves
that write before they return), its error raised at the next call and its measured cost kept.

The manager hands each save's persist function here and asks for it to end before anything that
must see the step committed (the next save, a read, retention, close). The background thread is
made when the first save arrives, so a manager that never saves starts none.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from crashsafe.errors import CrashsafeError, SaveFailedError
from crashsafe.saving import SaveStats

__all__ = ["PendingSave"]


class PendingSave:
    """One save at a time, in the background when ``background``; :attr:`stats` holds the cost of
    each one that committed, oldest first."""

    def __init__(self, background: bool) -> None:
        self.background = background
        self.stats: list[SaveStats] = []
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future[SaveStats] | None = None
        self._step: int | None = None

    def start(self, step: int, persist: Callable[[], SaveStats], began: float) -> float:
        """Persist ``step``: in the background (returns 0), or here and now (returns the seconds the
        caller waited on top of its stall, which that save's stats count as its stall)."""
        if not self.background:
            stats = persist()
            blocked = time.perf_counter() - began
            self.stats.append(dataclasses.replace(stats, stall=blocked))
            return blocked - stats.stall
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="crashsafe-persist")
        self._future, self._step = self._executor.submit(persist), step
        return 0.0

    @property
    def done(self) -> bool:
        """True when no save is running (one that ended may still have to be waited for)."""
        return self._future is None or self._future.done()

    def wait(self) -> None:
        """Until the save in flight is committed; raise its error (a SaveFailedError for one that
        is not crashsafe's own)."""
        future, step = self._future, self._step
        if future is None:
            return
        self._future = self._step = None
        try:
            self.stats.append(future.result())
        except CrashsafeError:
            raise
        except Exception as exc:
            raise SaveFailedError(
                f"saving step {step} in the background failed: {exc!r}. Committed checkpoints are intact."
            ) from exc

    def close(self) -> None:
        """Stop the background thread (after the save in flight ended)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
