"""The collective side of a CheckpointManager: what every rank calls together.

Rank 0 lists, locks, commits and deletes for everyone; the others follow its answers, so every
rank sees the same steps and restores the same one. A restore falls back together: if any rank's
part of the newest step is damaged, every rank goes on to the next older step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from crashsafe._log import logger
from crashsafe.distributed.group import Coordinator, distributed_group
from crashsafe.distributed.saving import ReplicaPlanner
from crashsafe.distributed.shards import Targets
from crashsafe.errors import (
    CorruptCheckpointError,
    CrashsafeError,
    NoCheckpointError,
    StorageError,
)
from crashsafe.loading import read_state, skip_damaged
from crashsafe.storage.base import Store

__all__ = ["Collective", "PeerProblem", "collective_for"]

_T = TypeVar("_T")


def collective_for(process_group: Any, timeout: float, mirror: str | None) -> Collective | None:
    """The collective side of a manager on ``process_group`` (or the default group when
    torch.distributed is initialized); None for a single process."""
    group = distributed_group(process_group)
    if group is None:
        return None
    if mirror is not None:
        raise CrashsafeError(
            "mirror= is not supported with a distributed manager yet; write to an object-store URL "
            "directly (every rank uploads its part)"
        )
    return Collective(group, timeout)


class PeerProblem(CrashsafeError):
    """Another rank's part of a step cannot be restored, so this rank leaves the attempt too,
    before it writes anything (:meth:`Collective.first_intact` reports the other rank's problem)."""


class Collective:
    """One manager's ranks on one process group."""

    def __init__(self, group: Any, timeout: float) -> None:
        self.coord = Coordinator(group, timeout)
        self.replicas = ReplicaPlanner(self.coord)  # plans this rank's saves
        # maybe_save's decisions, on the training thread: a group of their own, so that they never
        # meet the exchanges of a save persisting in the background on ``coord``
        self._decisions = Coordinator(group, timeout)

    def before_writing(self, problem: str | None, step: int) -> None:
        """Every rank's ``problem`` with its part of ``step`` (None: it can go into the live state),
        heard before any rank writes: PeerProblem on a rank whose part is fine if another's is not."""
        problems = self.coord.all_gather(problem, f"checking step {step} against every rank's live state")
        if problem is None and any(p is not None for p in problems):
            raise PeerProblem(f"another rank cannot restore its part of step {step}")

    def decide(self, wanted: bool, step: int) -> bool:
        """Rank 0's answer to "save ``step`` now?" on every rank: a policy decides on each rank's own
        measurements (a clock, a stall), and ranks that decide apart would save different steps."""
        return self._decisions.broadcast_flag(wanted, f"deciding whether to save step {step}")

    @property
    def rank(self) -> int:
        return self.coord.rank

    @property
    def leader(self) -> bool:
        return self.coord.leader

    def agree(self, fn: Callable[[], _T], what: str) -> _T:
        """``fn`` run by rank 0, its result (or its error) on every rank."""
        return self.coord.agree(fn, what)

    def steps(self, store: Store) -> list[int]:
        """The committed steps, as rank 0 lists them, on every rank."""
        return self.agree(store.steps, "listing steps")

    def load(
        self, store: Store, step: int | None, numpy: bool, targets: Targets | None, device: Any = None
    ) -> tuple[int, dict[str, Any]] | None:
        """Every rank's part of ``step``, or of the newest step every rank reads intact."""
        read = lambda at, _: read_state(store, at, numpy, self.rank, targets, device)  # noqa: E731
        return self.first_intact(store, step, read)

    def first_intact(
        self, store: Store, step: int | None, attempt: Callable[[int, bool], _T]
    ) -> tuple[int, _T] | None:
        """(step, this rank's ``attempt(step, last)``) for ``step``, or for the newest step every rank
        finds intact: while any rank finds its part damaged, every rank goes on to the next older
        step (``last``: none is left after it). Another error on any rank is raised on every rank,
        so no rank waits for the others; None if there is no step at all."""
        listed = self.steps(store)
        if step is not None and step not in listed:  # as for one process: not damage, a missing step
            raise NoCheckpointError(f"step {step} is not committed in {store.location}")
        candidates = [step] if step is not None else sorted(listed, reverse=True)
        damage = []
        for n, candidate in enumerate(candidates):
            result: Any = None
            problem, error = None, None
            try:
                result = attempt(candidate, step is not None or n == len(candidates) - 1)
            except PeerProblem:
                pass  # the other rank's problem is in the outcomes
            except (CorruptCheckpointError, StorageError, NoCheckpointError) as exc:
                problem = str(exc)
            except CrashsafeError as exc:
                error = exc
            outcomes = self.coord.all_gather((problem, error and str(error)), f"reading step {candidate}")
            if error is not None:
                raise error
            failed = "; ".join(f"rank {r}: {e}" for r, (_, e) in enumerate(outcomes) if e is not None)
            if failed:
                raise CrashsafeError(f"step {candidate} could not be restored by every rank: {failed}")
            bad = "; ".join(f"rank {r}: {p}" for r, (p, _) in enumerate(outcomes) if p is not None)
            if not bad:
                return candidate, result
            if step is not None:
                raise CorruptCheckpointError(f"step {step} cannot be read by every rank: {bad}")
            damage.append(bad)
            skip_damaged(
                f"skipping damaged checkpoint step {candidate} ({bad}); all ranks fall back to an older one"
            )
            logger().warning("fell back from step %d because %s", candidate, bad)
        if not candidates:
            return None
        raise CorruptCheckpointError(
            f"every checkpoint in {store.location} is damaged for some rank: {'; '.join(damage)}. "
            "Run `crashsafe verify` for details."
        )

    def close(self) -> None:
        self.coord.close()
        self._decisions.close()
