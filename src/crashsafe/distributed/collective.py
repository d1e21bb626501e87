"""The collective side of a CheckpointManager: what every process calls together, whether it runs
alone (a :class:`~crashsafe.distributed.group.Solo` coordination, where every exchange is a no-op)
or as a rank of a distributed job.

Rank 0 lists, locks, commits and deletes for everyone; the others follow its answers, so every
rank sees the same steps and restores the same one. A restore falls back together: if any rank's
part of the newest step is damaged, every rank goes on to the next older step
(:func:`crashsafe.loading.first_intact`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from crashsafe.distributed.group import SOLO, Coordination, Coordinator, distributed_group
from crashsafe.distributed.saving import PLAN_LATER, Listing, ReplicaPlanner
from crashsafe.distributed.shards import Targets, live_targets
from crashsafe.errors import CrashsafeError
from crashsafe.state.tree import flatten
from crashsafe.storage.base import Store

__all__ = ["Collective", "PeerProblem", "collective_for"]

_T = TypeVar("_T")


def collective_for(process_group: Any, timeout: float, mirror: str | None) -> Collective:
    """The collective side of a manager on ``process_group`` (or the default group when
    torch.distributed is initialized), or of one process alone."""
    group = distributed_group(process_group)
    if group is None:
        return Collective(SOLO, SOLO)
    if mirror is not None:
        raise CrashsafeError(
            "mirror= is not supported with a distributed manager yet; write to an object-store URL "
            "directly (every rank uploads its part)"
        )
    # maybe_save's decisions, on the training thread, have a group of their own, so that they never
    # meet the exchanges of a save persisting in the background
    return Collective(Coordinator(group, timeout), Coordinator(group, timeout))


class PeerProblem(CrashsafeError):
    """Another rank's part of a step cannot be restored, so this rank leaves the attempt too,
    before it writes anything (:func:`~crashsafe.loading.first_intact` reports the other rank's problem)."""


class Collective:
    """One manager's processes: ``coord`` for saves and reads, ``decisions`` for maybe_save."""

    def __init__(self, coord: Coordination, decisions: Coordination) -> None:
        self.coord = coord
        self.replicas = ReplicaPlanner(coord)  # plans this rank's saves
        self._decisions = decisions

    @property
    def rank(self) -> int:
        return self.coord.rank

    @property
    def leader(self) -> bool:
        return self.coord.leader

    @property
    def reader_rank(self) -> int | None:
        """The rank whose tree a read gives: its own; None for one process, which takes rank 0's
        (and says so when the step's ranks saved different states)."""
        return self.coord.rank if self.coord.shared else None

    def targets(self, state: Any) -> Targets | None:
        """Where the live state's DTensors sit in their global tensors (None: one process, which
        holds none)."""
        return live_targets(state, flatten(state)[1]) if self.coord.shared else None

    def before_writing(self, problem: str | None, step: int) -> None:
        """Every rank's ``problem`` with its part of ``step`` (None: it can go into the live state),
        heard before any rank writes: PeerProblem on a rank whose part is fine if another's is not."""
        problems = self.coord.all_gather(problem, f"checking step {step} against every rank's live state")
        if problem is None and any(p is not None for p in problems):
            raise PeerProblem(f"another rank cannot restore its part of step {step}")

    def committed(self, store: Store, step: int, planned: Listing, known: bool) -> bool:
        """Whether ``step`` is committed already, as far as a save call tells: by the listing the ranks
        agreed; one process planning later asks the store, unless ``known`` says the step is new
        (distributed, a plan made later checks in the background)."""
        if planned is not PLAN_LATER:
            return step in planned.committed
        return known and not self.coord.shared and store.has_step(step)

    def decide(self, wanted: bool, step: int) -> bool:
        """Rank 0's answer to "save ``step`` now?" on every rank: a policy decides on each rank's own
        measurements (a clock, a stall), and ranks that decide apart would save different steps."""
        return self._decisions.broadcast_flag(wanted, f"deciding whether to save step {step}")

    def agree(self, fn: Callable[[], _T], what: str) -> _T:
        """``fn`` run by rank 0, its result (or its error) on every rank."""
        return self.coord.agree(fn, what)

    def close(self) -> None:
        self.coord.close()
        self._decisions.close()
