"""Where the peer replicas of each rank's part go (docs/distributed.md, "Peer replicas: placement and
transfer"): on hosts other than the part's own and than each other's, so that losing any ``copies - 1``
hosts leaves a copy of every part, and spread so that every rank holds about as many copies."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from crashsafe.errors import InvalidArgumentError

__all__ = ["placement"]


def placement(hosts: Sequence[str], copies: int) -> list[tuple[int, ...]]:
    """For each rank r (``hosts[r]``: its host's name), the ranks holding a copy of r's part: r
    first, then ``copies - 1`` ranks, each on a host other than r's and than each other's, so any
    ``copies - 1`` lost hosts leave a copy of every part. Every rank computes the same from the same
    hosts. The copies are placed in rounds, one copy of every part a round (ranks in order), each on
    the least loaded rank it may go to, on the nearest such host after r's (hosts in name order,
    cyclically): where every host runs as many ranks, each rank holds exactly ``copies - 1`` copies,
    those of the ranks of the ``copies - 1`` hosts before its own."""
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise InvalidArgumentError(f"copies={copies!r}: give the number of copies of each part, 1 or more")
    names = sorted(set(hosts))
    if len(names) < copies:
        raise InvalidArgumentError(
            f"copies={copies} needs ranks on at least {copies} hosts, and the job's {len(hosts)} ranks run "
            f"on {len(names)} ({', '.join(names[:8])}): run on more hosts or keep fewer copies"
        )
    index = {name: i for i, name in enumerate(names)}
    loads = _Loads([index[h] for h in hosts], len(names))
    holders = [[r] for r in range(len(hosts))]
    for _ in range(copies - 1):
        for r, chosen in enumerate(holders):
            chosen.append(loads.take(r, {loads.host[c] for c in chosen}))
    return [tuple(chosen) for chosen in holders]


class _Loads:
    """How many copies each rank holds, per host the least loaded rank first."""

    def __init__(self, host: list[int], hosts: int) -> None:
        self.host = host
        self._free: list[list[tuple[int, int]]] = [[] for _ in range(hosts)]  # (copies held, rank) heaps
        for r, h in enumerate(host):
            self._free[h].append((0, r))  # (in rank order: already heaps)
        self._count = [len(host)]  # how many ranks hold 0, 1, ... copies
        self._least = 0  # the fewest copies any rank holds

    def take(self, owner: int, used: set[int]) -> int:
        """The rank to hold the next copy of ``owner``'s part: on a host not in ``used``, the least
        loaded, the nearest host after the owner's among equals (the scan stops at a host whose
        lightest rank is as light as any)."""
        start, hosts = self.host[owner], len(self._free)
        best: tuple[int, int] | None = None  # (copies held, host)
        for hop in range(1, hosts):
            other = (start + hop) % hosts
            if other not in used and (best is None or self._free[other][0][0] < best[0]):
                best = (self._free[other][0][0], other)
                if best[0] == self._least:
                    break
        assert best is not None  # (copies <= hosts)
        held, rank = heapq.heappop(self._free[best[1]])
        heapq.heappush(self._free[best[1]], (held + 1, rank))
        if held + 1 == len(self._count):
            self._count.append(0)
        self._count[held] -= 1
        self._count[held + 1] += 1
        while self._count[self._least] == 0:
            self._least += 1
        return rank
