"""Pieces of the parameter server without Ray: key layout, optimizers, a shard's books, settings."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crashsafe.errors import CrashsafeError
from crashsafe.ps import Failure, PSConfig, PSConfigError, ServerRecoveringError, optim
from crashsafe.ps.layout import BlockLayout, TableSpec
from crashsafe.ps.messages import decode_copy, encode_copy
from crashsafe.ps.server import ServerShard
from crashsafe.ps.worker import BlockStore, PSWorker, install_pull
from crashsafe.ps.workloads import make_workload
from crashsafe.ps.workloads.sparse_lr import hash_features


def test_layout_gather_scatter_round_trip() -> None:
    layout = BlockLayout([TableSpec("a", 10, 3, 4), TableSpec("b", 5, 2, 2)], servers=2)
    assert layout.n_blocks == 3 + 3
    assert layout.ranges == [(0, 3), (3, 6)]
    rng = np.random.default_rng(0)
    src = [rng.normal(size=(10, 3)).astype(np.float32), rng.normal(size=(5, 2)).astype(np.float32)]
    blocks = np.array([0, 2, 4, 5], np.int64)
    flat = layout.gather(src, [0, 0], blocks)
    assert flat.size == (4 + 2) * 3 + (2 + 1) * 2
    dst = [np.zeros_like(a) for a in src]
    layout.scatter(flat, dst, [0, 0], blocks)
    assert np.array_equal(dst[0][[0, 1, 2, 3, 8, 9]], src[0][[0, 1, 2, 3, 8, 9]])
    assert np.array_equal(dst[1][2:], src[1][2:]) and not dst[1][:2].any()
    assert layout.blocks_of_rows(1, np.array([0, 3, 4])).tolist() == [3, 4, 5]


def test_layout_gathers_right_rows_for_many_block_sets_in_any_order() -> None:
    """Remembered block sets (see BlockLayout._runs) never leak into another set's gather."""
    layout = BlockLayout([TableSpec("a", 40, 2, 3), TableSpec("b", 17, 1, 4)], servers=2)
    src = [np.arange(80, dtype=np.float32).reshape(40, 2), np.arange(17, dtype=np.float32).reshape(17, 1)]
    rng = np.random.default_rng(1)
    sets = [np.flatnonzero(rng.random(layout.n_blocks) < 0.5) for _ in range(40)]
    for blocks in [*sets, *sets[::-1]]:  # more sets than it remembers, each seen again later
        expect = [src[layout.table_of[b]][layout.row_lo[b] : layout.row_hi[b]].ravel() for b in blocks]
        got = layout.gather(src, [0, 0], blocks)
        assert np.array_equal(got, np.concatenate(expect) if expect else np.zeros(0, np.float32))
        assert np.array_equal(layout.gather(src, [0, 0], blocks.astype(np.int32)), got)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["sgd", "adagrad", "adam"]), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_optimizer_is_bit_identical_however_rows_are_batched(optimizer: str, splits: int, seed: int) -> None:
    """The property replay relies on: one step over all rows == steps over any partition of them."""
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(64, 24, replace=False)).astype(np.int64)
    values = rng.normal(size=(64, 3)).astype(np.float32)
    grads = [rng.normal(size=(24, 3)).astype(np.float32) for _ in range(3)]
    whole_v, whole_s = values.copy(), optim.init_state(optimizer, values.shape)
    parts_v, parts_s = values.copy(), optim.init_state(optimizer, values.shape)
    cuts = np.sort(rng.choice(np.arange(1, 24), min(splits, 23) - 1, replace=False)) if splits > 1 else []
    for g in grads:
        optim.step(optimizer, 0.05, whole_v, whole_s, rows, g)
        for idx in np.split(np.arange(24), cuts):
            optim.step(optimizer, 0.05, parts_v, parts_s, rows[idx], g[idx])
    assert whole_v.tobytes() == parts_v.tobytes()
    for name in whole_s:
        assert whole_s[name].tobytes() == parts_s[name].tobytes()


def _push(shard: ServerShard, worker: int, clock: int, rows: list[int]) -> dict[str, object]:
    r = np.array(rows, np.int64)
    return {"w": worker, "t": clock, "rows": [r], "grads": [np.full((r.size, 1), 0.5, np.float32)]}


def _config(replicas: int, lag: int = 1, optimizer: str = "sgd") -> PSConfig:
    return PSConfig(
        workload="sparse_lr",
        servers=1,
        workers=3,
        replicas=replicas,
        optimizer=optimizer,  # type: ignore[arg-type]
        recovery_lag=lag,  # default 1 here: the recovery point is the previous clock's end
        workload_options={"buckets": 64, "block_rows": 8, "samples": 64},
    )


def _shard(replicas: int, lag: int = 1, optimizer: str = "sgd") -> ServerShard:
    """Server 0 of a one-server job (with SGD every pulled block is a complete copy)."""
    return ServerShard(_config(replicas, lag, optimizer).to_dict(), 0)


class _Worker:
    """A worker's stores without Ray: the value cache and the complete copies kept from pulls."""

    def __init__(self, shard: ServerShard, w: int) -> None:
        self.shard, self.w = shard, w
        self.cache = BlockStore(shard.layout, shard.opt, 3, meta=False)
        self.pulled = BlockStore(shard.layout, shard.opt, 3, meta=True)

    def pull(self, blocks: list[int], clock: int) -> dict[str, np.ndarray]:
        reply = self.shard.pull(self.w, np.array(blocks, np.int64))
        install_pull(reply, clock, self.cache, self.pulled)
        return reply

    def report(self, retained: list[dict[str, object]]) -> dict[str, object]:
        empty = BlockStore(self.shard.layout, self.shard.opt, 3, meta=True)
        return {
            "w": self.w,
            "pulled": self.pulled.export(0, 8),
            "replica": empty.export(0, 8),
            "retained": retained,
        }


def test_shard_replicates_only_blocks_short_of_k_copies() -> None:
    shard = _shard(replicas=3)
    blocks = np.arange(8, dtype=np.int64)
    for w in range(3):  # every worker pulls everything: N copies of version 0
        shard.pull(w, blocks)
    shard.push(_push(shard, 0, 0, [0, 1]))  # block 0: pulled by all -> its recovery point has 3 copies
    shard.push(_push(shard, 1, 0, [9, 17]))
    out = shard.end_clock(0)
    assert shard.version.tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert (out["changed"].tolist(), out["counts"].tolist()) == ([0, 1, 2], [1, 1, 1])  # only what changed
    assert out["replicas"] == {}  # version 0 of blocks 0-2 is held by every worker
    for w in range(3):  # clock 1: everyone reads blocks 0 and 2; only worker 2 reads block 1
        shard.pull(w, np.array([0, 2] + ([1] if w == 2 else []), np.int64))
    shard.push(_push(shard, 2, 1, [9]))
    out = shard.end_clock(1)
    assert shard.version.tolist() == [1, 2, 1, 0, 0, 0, 0, 0]
    # Block 1's recovery point (version 1, the end of clock 0) has one worker copy (worker 2's) where
    # k=3 needs two: its current version goes to one more worker's replica store, not to every worker.
    (copy,) = map(decode_copy, out["replicas"].values())
    assert copy["blocks"].tolist() == [1] and copy["meta"][:, 0].tolist() == [2]
    assert 2 not in out["replicas"]  # worker 2 already counts
    assert shard.copies(shard.version).tolist() == [3, 1, 3, 3, 3, 3, 3, 3]
    # Next clock the recovery point moves to version 2, which has one copy: one more push, then none.
    assert [decode_copy(c)["blocks"].tolist() for c in shard.end_clock(2)["replicas"].values()] == [[1]]
    assert shard.copies(shard.version).tolist() == [3, 2, 3, 3, 3, 3, 3, 3]
    assert shard.end_clock(3)["replicas"] == {}


def test_longer_recovery_lag_lets_a_recent_pull_count() -> None:
    shard = _shard(replicas=2, lag=2)
    one = np.array([1], np.int64)
    for clock in range(2):  # worker 0 reads and updates block 1 twice
        shard.pull(0, one)
        shard.push(_push(shard, 0, clock, [9]))
        assert shard.end_clock(clock)["replicas"] == {}
    # Recovery point = version at the end of clock 0 (v1); worker 0's copy (v1) still counts.
    assert shard.end_clock(2)["replicas"] == {}
    # Now the recovery point is v2, which no worker holds: one replica.
    assert [decode_copy(c)["blocks"].tolist() for c in shard.end_clock(3)["replicas"].values()] == [[1]]


def test_pulls_carry_optimizer_state_only_for_blocks_short_of_copies() -> None:
    shard = _shard(replicas=2, lag=2, optimizer="adam")
    workers = [_Worker(shard, w) for w in range(3)]
    full: list[list[list[int]]] = []
    for clock in range(6):  # a dense job: every worker reads and updates blocks 0-3 every clock
        full.append([np.asarray(wk.pull([0, 1, 2, 3], clock).get("full", [])).tolist() for wk in workers])
        for w in range(3):
            shard.push(_push(shard, w, clock, [0, 8, 16, 24]))
        point = shard._point()
        assert shard.end_clock(clock)["replicas"] == {}  # the pulls alone keep k copies:
        assert np.all((shard.copies(point) >= 1) | (point == 0))  # a worker copy of every recovery point
    # Until clock `lag` the recovery point is version 0 (regenerable): no state at all. Then the
    # first puller gets the state of every block (k - 1 = 1 copy needed), which stays valid for
    # `lag` clock ends; the other workers' pulls carry values only.
    assert full == [[[], [], []]] * 2 + [[[0, 1, 2, 3], [], []], [[], [], []]] * 2
    # The complete copy a worker keeps is the version it pulled, not the newer values it reads.
    kept = workers[0].pulled
    assert kept.ver[:4].tolist() == [4, 4, 4, 4] and workers[1].pulled.ver[:4].tolist() == [-1] * 4
    assert workers[0].cache.values[0].tobytes() != kept.values[0].tobytes()


def _randomize(shard: ServerShard, rng: np.random.Generator) -> None:
    """Fill a shard's values and optimizer state with random numbers."""
    for ti, slab in enumerate(shard.slabs):
        slab[...] = rng.normal(size=slab.shape)
        for n in shard.state_names:
            shard.state[n][ti][...] = rng.normal(size=slab.shape)


def test_replica_copies_gathered_once_equal_a_gather_per_worker() -> None:
    """_split_copy cuts one gather into per-worker copies: the same bytes as gathering each alone
    (tables of different widths, optimizer state included)."""
    cfg = PSConfig(workload="digits", servers=1, workers=4, replicas=3, optimizer="adam")
    shard = ServerShard(cfg.to_dict(), 0)
    rng = np.random.default_rng(0)
    _randomize(shard, rng)
    shard.version[...] = rng.integers(1, 9, shard.nb)
    shard.applied[...] = rng.integers(0, 9, shard.applied.shape)
    blocks = np.flatnonzero(rng.random(shard.nb) < 0.6).astype(np.int64)
    pick = rng.random((blocks.size, 4)) < 0.4
    pick[:, 3] = False  # a worker that gets nothing gets no copy
    out = shard._split_copy(blocks, pick)
    assert sorted(out) == [w for w in range(3) if pick[:, w].any()]
    for w, copy in out.items():
        mine = blocks[pick[:, w]]
        alone = {"v": shard.layout.gather(shard.slabs, shard.bases, mine), **shard._copy_meta(mine)}
        assert copy["blocks"].tolist() == mine.tolist()
        for key in ("v", "s", "meta"):
            assert copy[key].tobytes() == alone[key].tobytes()


@pytest.mark.parametrize(("optimizer", "consistency"), [("sgd", "bsp"), ("adam", "ssp"), ("adagrad", "bsp")])
def test_replica_copies_cross_as_bytes_unchanged(optimizer: str, consistency: str) -> None:
    """encode_copy/decode_copy: the same blocks, values, state and metadata, bit for bit."""
    cfg = PSConfig(workload="digits", servers=1, workers=4, optimizer=optimizer, consistency=consistency)  # type: ignore[arg-type]
    shard = ServerShard(cfg.to_dict(), 0)
    rng = np.random.default_rng(5)
    _randomize(shard, rng)
    shard.applied[...] = rng.integers(-1, 50, shard.applied.shape)
    for blocks in (np.array([0, 3, 4, shard.nb - 1], np.int64), np.zeros(0, np.int64)):
        copy = {"blocks": blocks, "v": shard.layout.gather(shard.slabs, shard.bases, blocks)}
        copy.update(shard._copy_meta(blocks))
        back = decode_copy(encode_copy(copy))
        assert sorted(back) == sorted(copy)
        for key, value in copy.items():
            assert back[key].dtype == value.dtype and back[key].shape == value.shape
            assert back[key].tobytes() == value.tobytes()


def test_sgd_copies_from_pulls_share_the_cache_tables() -> None:
    """Without optimizer state every pull is a complete copy, so the worker keeps one set of values
    for its cache and its copies; with state (or without FreeLauncher) they stay apart."""
    base = {
        "workload": "sparse_lr",
        "servers": 1,
        "workers": 3,
        "workload_options": {"buckets": 64, "block_rows": 8, "samples": 64},
    }
    sgd = PSWorker(PSConfig(**base, optimizer="sgd").to_dict(), 0)  # type: ignore[arg-type]
    assert sgd.pulled.values is sgd.cache.values and sgd.replicas.values is not sgd.cache.values
    for other in ({"optimizer": "adagrad"}, {"optimizer": "sgd", "mode": "none"}):
        apart = PSWorker(PSConfig(**base, **other).to_dict(), 0)  # type: ignore[arg-type]
        assert apart.pulled.values is not apart.cache.values
    shard = ServerShard(sgd.cfg.to_dict(), 0)
    latest = {}
    for clock, blocks in enumerate(([0, 2, 5], [2, 3])):
        shard.push(_push(shard, 1, clock, [1, 17, 20]))  # blocks 0 and 2 change every clock
        shard.end_clock(clock)
        reply = shard.pull(0, np.array(blocks, np.int64))
        install_pull(reply, clock, sgd.cache, sgd.pulled)
        latest.update({b: reply["v"][8 * i : 8 * i + 8] for i, b in enumerate(blocks)})
    copy = sgd.pulled.export(0, 8)
    assert copy["blocks"].tolist() == [0, 2, 3, 5]
    assert copy["meta"][:, 0].tolist() == [1, 2, 0, 0]  # block 0 as pulled at clock 0, not as now (v2)
    assert copy["v"].tobytes() == np.concatenate([latest[b] for b in (0, 2, 3, 5)]).tobytes()


def test_replica_store_installs_received_copies_in_batches_as_if_one_by_one() -> None:
    """A replica store installs the copies it receives in batches (last received wins per block);
    export sees every copy received so far, exactly as installing each on arrival would."""
    cfg = PSConfig(workload="digits", servers=1, workers=4, replicas=3, optimizer="adam")
    shard = ServerShard(cfg.to_dict(), 0)
    batched = BlockStore(shard.layout, "adam", 4, meta=True)
    eager = BlockStore(shard.layout, "adam", 4, meta=True)
    rng = np.random.default_rng(3)
    for step in range(45):  # more copies than a batch, overlapping blocks, tables of different widths
        _randomize(shard, rng)
        shard.version[...] = step + 1
        blocks = np.flatnonzero(rng.random(shard.nb) < 0.3).astype(np.int64)
        copy = {"blocks": blocks, "v": shard.layout.gather(shard.slabs, shard.bases, blocks)}
        copy.update(shard._copy_meta(blocks))
        batched.receive(copy)
        eager.install(copy, 0)
        if step in (0, 7, 44):  # export mid-batch too
            a, b = batched.export(0, shard.nb), eager.export(0, shard.nb)
            assert a["blocks"].tolist() == b["blocks"].tolist()
            for key in ("v", "s", "meta"):
                assert a[key].tobytes() == b[key].tobytes()


def test_rebuilt_shard_refuses_traffic_and_replays_in_worker_order() -> None:
    live = _shard(replicas=2, optimizer="adagrad")
    workers = [_Worker(live, w) for w in range(3)]
    pushes: list[list[dict[str, object]]] = [[], [], []]
    for clock in range(2):
        for wk in workers:
            wk.pull(list(range(8)), clock)  # clock 1: worker 0's pull carries the state of blocks 0, 1
        for w in (2, 0, 1):
            pushes[w].append(_push(live, w, clock, [w, 8 + w]))
            live.push(pushes[w][-1])
        live.end_clock(clock)
    assert workers[0].pulled.ver[:3].tolist() == [1, 1, -1] and workers[1].pulled.ver[:3].tolist() == [-1] * 3

    rebuilt = ServerShard(live.cfg.to_dict(), None)  # a standby
    with pytest.raises(ServerRecoveringError, match="standby"):
        rebuilt.pull(0, np.arange(8, dtype=np.int64))
    rebuilt.take_over(0, live.cfg.to_dict())
    with pytest.raises(ServerRecoveringError, match="rebuilding"):
        rebuilt.pull(0, np.arange(8, dtype=np.int64))
    # Acknowledged up to clock 0: workers retain clock 1's pushes; worker 0 holds the base copies.
    reports = [wk.report([pushes[wk.w][1]]) for wk in workers]
    out = rebuilt.recover(1, live.n_applied.astype(np.int32), *reports)
    assert out["missing"].size == 0 and out["replayed"] == 3 and not rebuilt.recovering
    assert out["copies_used"] == 2
    assert rebuilt.slabs[0].tobytes() == live.slabs[0].tobytes()
    assert rebuilt.state["acc"][0].tobytes() == live.state["acc"][0].tobytes()
    assert rebuilt.version.tolist() == live.version.tolist()

    lossy = ServerShard(live.cfg.to_dict(), None)
    lossy.take_over(0, live.cfg.to_dict())
    out = lossy.recover(1, live.n_applied.astype(np.int32), *reports[1:])  # worker 0's copies are gone
    assert out["missing"].tolist() == [0, 1] and lossy.recovering  # both blocks clock 0 updated


def test_workloads_are_deterministic_and_zipfian() -> None:
    a, b = make_workload("sparse_lr", 3), make_workload("sparse_lr", 3)
    a.load(1, 4)
    b.load(1, 4)
    assert np.array_equal(a.batch(1, 7, 32)[0], b.batch(1, 7, 32)[0])
    counts = np.bincount(a.features.ravel(), minlength=1 << 16)
    top = np.sort(counts)[::-1]
    assert top[0] > 50 * np.median(counts[counts > 0])  # a hot head and a long tail
    assert hash_features(np.array([0, 1, 2]), 1 << 16).max() < 1 << 16
    mf = make_workload("mf", 0)
    mf.load(0, 1)
    items = np.bincount(mf.data[1])
    assert items.max() > 20 * np.median(items[items > 0])
    digits = make_workload("digits", 0)
    digits.load(0, 2)
    grads, loss = digits.grad(digits.batch(0, 0, 16), digits.init_params())
    assert [g.shape for g in grads] == [(64, 64), (1, 64), (64, 10), (1, 10)] and loss > 1.5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"workload": "mnist"}, "unknown workload 'mnist'"),
        ({"replicas": 6, "workers": 4}, "needs 5 worker copies .* only 4 workers"),
        ({"mode": "checkpoint"}, "needs checkpoint_dir and checkpoint_every"),
        ({"consistency": "ssp", "staleness": 0}, "staleness bound >= 1"),
        ({"servers": 0}, "servers must be an int >= 1"),
    ],
)
def test_bad_settings_say_what_to_change(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(PSConfigError, match=match) as info:
        PSConfig(**kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, CrashsafeError)


def test_failure_must_name_a_victim() -> None:
    with pytest.raises(PSConfigError, match="at least one server or worker"):
        Failure(clock=3)
