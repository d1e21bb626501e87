"""Where the peer replicas of each rank's part go: on distinct hosts, the owner first, the same on
every rank, surviving any ``copies - 1`` lost hosts, and spread evenly (hypothesis over jobs of
1 to 7 hosts of 1 to 6 ranks each, in any rank order)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crashsafe.distributed.peers import placement
from crashsafe.errors import InvalidArgumentError


@st.composite
def jobs(draw: st.DrawFn, equal: bool = False) -> tuple[list[str], int]:
    """The host of each rank (hosts of 1 to 6 ranks, in any rank order), and a number of copies."""
    count = draw(st.integers(1, 7))
    sizes = (
        [draw(st.integers(1, 6))] * count
        if equal
        else draw(st.lists(st.integers(1, 6), min_size=count, max_size=count))
    )
    names = draw(
        st.lists(st.text("abcnode-0123", min_size=1, max_size=6), min_size=count, max_size=count, unique=True)
    )
    hosts = draw(st.permutations([name for name, n in zip(names, sizes, strict=True) for _ in range(n)]))
    return list(hosts), draw(st.integers(1, count))


def _held(holders: list[tuple[int, ...]]) -> list[int]:
    """How many copies (besides its own part) each rank holds."""
    held = [0] * len(holders)
    for chosen in holders:
        for rank in chosen[1:]:
            held[rank] += 1
    return held


@settings(max_examples=300, deadline=None)
@given(jobs())
def test_copies_go_to_distinct_hosts_owner_first_and_survive_any_lost_hosts(
    job: tuple[list[str], int],
) -> None:
    hosts, copies = job
    holders = placement(hosts, copies)
    assert holders == placement(tuple(hosts), copies)  # every rank computes the same
    assert len(holders) == len(hosts)
    for rank, chosen in enumerate(holders):
        assert chosen[0] == rank and len(chosen) == copies
        assert len({hosts[r] for r in chosen}) == copies  # each copy on a host of its own
    for lost in itertools.combinations(sorted(set(hosts)), copies - 1):
        assert all(any(hosts[r] not in lost for r in chosen) for chosen in holders), lost
    # balanced: a copy goes to a least loaded rank it may go to; at that moment every rank of the
    # N - (copies - 1) * largest ranks it could go to held as many, so no rank ends with more than:
    n, largest, extra = len(hosts), max(hosts.count(h) for h in hosts), copies - 1
    if extra and n > extra * largest:
        assert max(_held(holders)) <= (extra * n - 1) // (n - extra * largest) + 1


@settings(max_examples=200, deadline=None)
@given(jobs(equal=True))
def test_every_rank_holds_as_many_copies_where_hosts_run_as_many_ranks(job: tuple[list[str], int]) -> None:
    hosts, copies = job
    assert _held(placement(hosts, copies)) == [copies - 1] * len(hosts)


def test_four_ranks_on_two_hosts_each_keep_a_copy_on_the_other() -> None:
    hosts = ["b", "b", "a", "a"]
    holders = placement(hosts, 2)
    assert [hosts[chosen[1]] for chosen in holders] == ["a", "a", "b", "b"]
    assert sorted(chosen[1] for chosen in holders) == [0, 1, 2, 3]  # one copy each
    assert placement(hosts, 1) == [(0,), (1,), (2,), (3,)]


@pytest.mark.parametrize(
    ("hosts", "copies", "match"),
    [
        (["a", "a", "b"], 3, "copies=3 needs ranks on at least 3 hosts.* run on 2 .*: run on more hosts"),
        (["a"], 2, "at least 2 hosts"),
        (["a", "b"], 0, "1 or more"),
        (["a", "b"], True, "1 or more"),
    ],
)
def test_too_few_hosts_or_no_copies_are_refused(hosts: list[str], copies: int, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        placement(hosts, copies)
