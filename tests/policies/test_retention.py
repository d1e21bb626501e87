"""Keep policies: each one on its own, their union in a real store with delta chains (hypothesis over
steps, metrics, commit times and bases, checked against an independent oracle), in the manager after
every save, best_step and restore(step="best"), the caches, and `crashsafe gc` on the command line."""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import crashsafe as cs
from crashsafe.chain import direct_bases, doomed_steps
from crashsafe.format.manifest import MANIFEST_NAME, Manifest, PayloadEntry
from crashsafe.policies import (
    KeepBest,
    KeepEvery,
    KeepEveryInterval,
    KeepLast,
    KeepPolicy,
    KeepUnion,
    PolicyError,
    StepFacts,
)
from crashsafe.policies.retention import UNSET, retention_policy
from crashsafe.storage.base import Store
from crashsafe.storage.layout import step_dir
from crashsafe.storage.stores import open_store
from crashsafe.storage.writer import StepWriter, delete_steps

from .retention_oracle import expected_kept, oracle_keep

SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else None  # tmpfs: fsync is free, saves take ~1 ms
DELTA = cs.codecs.Incremental(full_every=3)


@pytest.fixture
def fast_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(dir=SHM))
    yield path / "ckpt"
    shutil.rmtree(path)


def _facts(table: dict[int, StepFacts]) -> Any:
    return table.__getitem__


# ----------------------------------------------------------------------------- each policy


def test_each_policy_on_a_small_run() -> None:
    steps = [0, 5, 10, 15, 20, 25]
    table = {
        0: StepFacts(0.0, {"loss": 3.0}),
        5: StepFacts(100.0, {"loss": 1.0}),
        10: StepFacts(3500.0, {"loss": "nan"}),
        15: StepFacts(3600.0, {"loss": 1.0}),
        20: StepFacts(7300.0, {"acc": 0.9}),
        25: StepFacts(7400.0, {"loss": 2.0}),
    }
    facts = _facts(table)
    assert KeepLast(2).keep(steps, facts) == {20, 25}
    assert KeepEvery(10).keep(steps, facts) == {0, 10, 20}
    assert KeepEveryInterval("1h").keep(steps, facts) == {0, 15, 20}
    assert KeepBest(2, "loss").keep(steps, facts) == {5, 15, 10, 20}  # tie 5/15 both in; nan, none kept
    assert KeepBest(1, "loss").keep(steps, facts) == {15, 10, 20}  # a tie goes to the newer step
    assert KeepBest(1, "loss", missing="drop").keep(steps, facts) == {15}
    assert KeepBest(2, "loss", mode="max", missing="drop").keep(steps, facts) == {0, 25}
    union = KeepLast(1) | KeepEvery(10) | KeepBest(1, "loss", missing="drop")
    assert isinstance(union, KeepUnion) and len(union.policies) == 3  # flattened
    assert union.keep(steps, facts) == {25, 0, 10, 20, 15}
    assert repr(KeepLast(1) | KeepEvery(2)) == "KeepLast(n=1) | KeepEvery(steps=2)"


def test_policies_that_need_no_facts_read_none() -> None:
    def no_facts(step: int) -> StepFacts:
        raise AssertionError("read")

    assert (KeepLast(2) | KeepEvery(3)).keep([1, 2, 3, 4], no_facts) == {3, 4}


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: KeepLast(0), r"KeepLast\(n\) must be an int >= 1"),
        (lambda: KeepLast(True), "KeepLast"),
        (lambda: KeepEvery(2.5), r"KeepEvery\(steps\)"),
        (lambda: KeepEveryInterval(0), "positive and finite"),
        (lambda: KeepEveryInterval("inf"), "positive and finite"),
        (lambda: KeepEveryInterval("soon"), "cannot read 'soon'"),
        (lambda: KeepBest(3, ""), "metric must be the name"),
        (lambda: KeepBest(3, "loss", mode="lowest"), "mode must be 'min'"),
        (lambda: KeepBest(3, "loss", missing="skip"), "missing must be 'keep' or 'drop'"),
        (lambda: KeepUnion(), "at least one"),
        (lambda: KeepUnion(KeepLast(1), 3), "3 is not a keep policy"),
    ],
)
def test_impossible_settings_are_refused(make: Any, match: str) -> None:
    with pytest.raises(PolicyError, match=match):
        make()


def test_the_manager_arguments() -> None:
    assert retention_policy(None, UNSET, None, default_last=3) == KeepLast(3)
    assert retention_policy(None, 2, 5) == KeepLast(2) | KeepEvery(5)
    assert retention_policy(None, None, 5) is None  # keep_last=None keeps all, as before
    assert retention_policy(None, UNSET, None) is None  # the mirror's default
    assert retention_policy([KeepLast(1), KeepEvery(4)], UNSET, None) == KeepLast(1) | KeepEvery(4)
    with pytest.raises(PolicyError, match="either mirror_keep= or mirror_keep_last"):
        retention_policy(KeepLast(1), None, None, "mirror_")
    with pytest.raises(PolicyError, match="either keep= or keep_last"):
        retention_policy(KeepLast(1), UNSET, 10)
    with pytest.raises(PolicyError, match="non-empty list"):
        retention_policy([], UNSET, None)
    with pytest.raises(PolicyError, match="keep_every must be None or an int >= 1"):
        retention_policy(None, 3, 0)


# ----------------------------------------------------------------------------- properties of the policies

METRIC_VALUES = st.one_of(
    st.integers(0, 4).map(float), st.integers(0, 4), st.sampled_from(["nan", "inf", None, True, "x"])
)
POLICIES = st.one_of(
    st.builds(KeepLast, st.integers(1, 4)),
    st.builds(KeepEvery, st.integers(2, 7)),
    st.builds(KeepEveryInterval, st.integers(5, 40)),
    st.builds(
        KeepBest,
        st.integers(1, 3),
        st.just("m"),
        st.sampled_from(["min", "max"]),
        st.sampled_from(["keep", "drop"]),
    ),
)
UNIONS = st.lists(POLICIES, min_size=1, max_size=3).map(lambda ps: KeepUnion(*ps))


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[int], dict[int, StepFacts], dict[int, set[int]]]:
    """Committed steps with commit times (ties and out of step order), metrics and delta bases."""
    steps = sorted(draw(st.sets(st.integers(0, 60), min_size=1, max_size=14)))
    facts, bases = {}, {}
    for step in steps:
        metrics = {} if draw(st.booleans()) and draw(st.booleans()) else {"m": draw(METRIC_VALUES)}
        facts[step] = StepFacts(float(draw(st.integers(0, 100))), metrics)
        earlier = [s for s in steps if s < step]
        bases[step] = set(draw(st.lists(st.sampled_from(earlier), max_size=2))) if earlier else set()
    return steps, facts, bases


@settings(max_examples=300, deadline=None)
@given(histories(), UNIONS, st.data())
def test_every_policy_keeps_what_its_definition_says_and_is_stable(
    history: tuple[list[int], dict[int, StepFacts], dict[int, set[int]]],
    union: KeepUnion,
    data: st.DataObject,
) -> None:
    steps, table, _ = history
    facts = _facts(table)
    for policy in (*union.policies, union):
        kept = set(policy.keep(steps, facts))
        assert kept <= set(steps)
        assert kept == oracle_keep(policy, steps, table)
        # applied again to what survives a deletion (kept plus any others), it keeps the same
        others = data.draw(st.sets(st.sampled_from(steps)))
        survivors = sorted(kept | others)
        assert set(policy.keep(survivors, facts)) == kept


# ----------------------------------------------------------------------------- retention in a real store


def write_step(store: Store, step: int, facts: StepFacts, bases: set[int]) -> None:
    """A committed step with one small payload per delta base (manifest as the writer validates it)."""
    writer = StepWriter(store, step)
    paths = [f"p{base}" for base in sorted(bases)] or ["full"]
    entries = []
    for path in paths:
        put = writer.write_payload(np.full(1, float(step)).tobytes())
        base = int(path[1:]) if path != "full" else None
        where = (put.file, put.offset, put.nbytes, put.xxh3)
        entries.append(PayloadEntry(path, "numpy", "float64", (1,), *where, {"id": "raw"}, base))
    tree = {"t": "dict", "keys": paths, "vals": [{"t": "array", "id": i} for i in range(len(paths))]}
    writer.commit(Manifest(step, facts.created, tree, tuple(entries), writer.files(), dict(facts.metrics)))


class CountingStore:
    """A store that counts the steps opened (each manifest read opens one)."""

    def __init__(self, store: Store) -> None:
        self.store, self.opened = store, 0

    def open_step(self, step: int) -> Any:
        self.opened += 1
        return self.store.open_step(step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories(), UNIONS, st.data())
def test_retention_keeps_exactly_the_union_the_newest_the_pinned_and_their_bases(
    history: tuple[list[int], dict[int, StepFacts], dict[int, set[int]]],
    union: KeepUnion,
    data: st.DataObject,
) -> None:
    steps, table, bases = history
    pinned = data.draw(st.sets(st.sampled_from(steps), max_size=2))
    damaged = data.draw(
        st.sets(st.sampled_from(steps), max_size=1)
    )  # manifest unreadable: no facts, no bases
    root = Path(tempfile.mkdtemp(dir=SHM))
    try:
        store = open_store(root, create=True)
        for step in steps:
            write_step(store, step, table[step], bases[step])
        for step in damaged:
            (step_dir(root, step) / MANIFEST_NAME).write_bytes(b"{not json")
            table[step], bases[step] = StepFacts(math.nan), set()
        counting = CountingStore(store)
        known: dict[int, frozenset[int]] = {}
        cache: dict[int, StepFacts] = {}
        doomed = doomed_steps(counting, union, known, keep=pinned, facts=cache)  # type: ignore[arg-type]
        assert set(steps) - set(doomed) == expected_kept(steps, table, bases, union, pinned)
        assert counting.opened <= len(steps) + len(damaged)  # each manifest read once (a damaged one twice)
        delete_steps(store, doomed)
        counting.opened = 0
        assert doomed_steps(counting, union, known, keep=pinned, facts=cache) == []  # type: ignore[arg-type]
        assert counting.opened == 0  # warm caches: no manifest read again
        assert set(cache) <= set(store.steps())  # deleted steps leave the cache
        store.close()
    finally:
        shutil.rmtree(root)


# ---------------------------------------------------------------------- in the manager, after every save

SAVES = st.lists(
    st.tuples(st.integers(-3, 4), st.one_of(st.none(), st.integers(0, 5).map(float), st.just(math.nan))),
    min_size=1,
    max_size=14,
)
MANAGER_POLICIES = st.one_of(
    st.builds(KeepLast, st.integers(1, 3)),
    st.builds(KeepEvery, st.integers(2, 5)),
    st.builds(KeepEveryInterval, st.floats(0.001, 0.01)),
    st.builds(
        KeepBest,
        st.integers(1, 3),
        st.just("val"),
        st.sampled_from(["min", "max"]),
        st.sampled_from(["keep", "drop"]),
    ),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SAVES, st.lists(MANAGER_POLICIES, min_size=1, max_size=3))
@example(  # step 9 deleted, then saved again with a metric: ranked by the new one, not a cached old one
    saves=[(0, None), (-1, None), (-1, 0.0), (1, 0.0)], policies=[KeepBest(1, "val", "min", "drop")]
)
def test_after_every_save_the_manager_keeps_exactly_what_it_must(
    saves: list[tuple[int, float | None]], policies: list[KeepPolicy]
) -> None:
    """Real saves with a delta codec (chains), rewinds (a step below the newest) and metrics that are
    missing or NaN: after each one the committed steps are what the oracle says."""
    root = Path(tempfile.mkdtemp(dir=SHM))
    table: dict[int, StepFacts] = {}
    bases: dict[int, set[int]] = {}
    try:
        with cs.CheckpointManager(root, keep=policies, async_save=False, codec={"w": DELTA}) as mgr:
            step = 10
            for move, val in saves:
                step = max(0, step + move)
                before = set(mgr.steps())
                if step in before:
                    continue
                mgr.save(
                    step, {"w": np.full(8, float(step)), "step": step}, {} if val is None else {"val": val}
                )
                manifest = mgr.manifest(step)  # the step just saved is always kept
                table[step] = StepFacts(manifest.created, manifest.metrics)
                bases[step] = set(direct_bases(manifest))
                assert set(mgr.steps()) == expected_kept(
                    sorted(before | {step}), table, bases, KeepUnion(*policies), {step}
                )
            for kept in mgr.steps():
                assert mgr.load(kept)["step"] == kept
    finally:
        shutil.rmtree(root)
