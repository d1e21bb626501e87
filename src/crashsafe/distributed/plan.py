"""Who writes what: replicated arrays once, the writing spread evenly over the ranks.

Every rank offers each array of its state as (path, fingerprint, bytes): the fingerprint is its
type, shape and shard placement plus the xxh3 of its bytes (or, for an array no other rank holds
alike, its rank: it is not hashed). Arrays that several ranks offer with the same path and
fingerprint hold the same bytes (a DDP replica's parameters and optimizer state, a
replicated DTensor), so one of those ranks writes them for all; arrays that differ (a DTensor's
shards, each rank's RNG state) are written by their own rank. Groups are handed out largest first,
each to the holder with the fewest bytes so far (DCP's dedup-and-balance, made content-aware). Every
rank computes the same plan from the same offers, so no extra round trip is needed.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

__all__ = ["Offer", "Plan", "assign"]


@dataclass(frozen=True)
class Offer:
    """One array a rank holds."""

    path: str
    fingerprint: str  # type, shape, shard placement + the xxh3 of the bytes (or the rank)
    nbytes: int


@dataclass(frozen=True)
class Plan:
    """The writer of every (rank, array index), and how many bytes each rank writes."""

    writer: dict[tuple[int, int], tuple[int, int]]  # (rank, index) -> (writing rank, its index)
    bytes_per_rank: tuple[int, ...]

    def writes(self, rank: int) -> list[int]:
        """Indices of ``rank``'s arrays that ``rank`` itself writes."""
        return sorted(i for (r, i), (w, j) in self.writer.items() if r == rank and (w, j) == (r, i))


def assign(offers: list[list[Offer]]) -> Plan:
    """The plan for the ranks' ``offers`` (a list per rank, in each rank's array order)."""
    groups: dict[tuple[str, str], list[tuple[int, int]]] = {}
    sizes: dict[tuple[str, str], int] = {}
    for rank, rank_offers in enumerate(offers):
        for index, offer in enumerate(rank_offers):
            key = (offer.path, offer.fingerprint)
            groups.setdefault(key, []).append((rank, index))
            sizes[key] = offer.nbytes
    load = [(0, rank) for rank in range(len(offers))]  # (bytes so far, rank): a min-heap
    written = [0] * len(offers)
    writer: dict[tuple[int, int], tuple[int, int]] = {}
    for key in sorted(groups, key=lambda k: (-sizes[k], k)):
        holders = groups[key]
        held_by = {rank for rank, _ in holders}
        chosen = _least_loaded(load, held_by)
        written[chosen] += sizes[key]
        heapq.heappush(load, (written[chosen], chosen))
        index = next(i for r, i in holders if r == chosen)
        for holder in holders:
            writer[holder] = (chosen, index)
    return Plan(writer, tuple(written))


def _least_loaded(load: list[tuple[int, int]], candidates: set[int]) -> int:
    """Pop the least loaded rank among ``candidates`` from the heap (stale entries are skipped)."""
    skipped = []
    try:
        while True:
            written, rank = heapq.heappop(load)
            if rank in candidates:
                return rank
            skipped.append((written, rank))
    finally:
        for entry in skipped:
            heapq.heappush(load, entry)
