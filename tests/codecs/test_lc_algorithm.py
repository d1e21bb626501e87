"""LC-checkpoint does what the paper says: (sign, exponent) buckets, priority promotion, bucket
representatives, approximate tracking, table caching, periodic full saves, bounded memory."""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np
import pytest

from crashsafe.codecs import LC, Reference
from crashsafe.codecs.lc import BLOCK


def oracle(delta: np.ndarray[Any, Any], bits: int, rep: str) -> np.ndarray[Any, Any]:
    """Straight from the spec, with frexp instead of bit tricks: what LC must reconstruct from 0."""
    d = delta.astype(np.float64)
    _, exponent = np.frexp(d)
    normal = np.isfinite(d) & (np.abs(d) >= np.finfo(np.float32).tiny)
    buckets: dict[tuple[bool, int], np.ndarray[Any, Any]] = {}
    for negative in (False, True):
        for e in np.unique(exponent[normal & ((d < 0) == negative)]):
            buckets[(negative, int(e))] = np.flatnonzero(normal & ((d < 0) == negative) & (exponent == e))
    reps = {}
    for key, idx in buckets.items():
        values = d[idx]
        reps[key] = (values.max() + values.min()) / 2 if rep == "midrange" else values.mean()
    kept = sorted(reps, key=lambda k: (-abs(reps[k]), k[0]))[: 2**bits - 1]
    out = np.zeros(delta.shape, dtype=np.float32)
    for key in kept:
        out[buckets[key]] = np.float32(reps[key])
    return out


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_midrange_buckets_and_priority_promotion_match_the_spec(bits: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 5000
    delta = (rng.standard_t(2, n) * 10.0 ** rng.integers(-5, 2, n)).astype(np.float32)
    delta[rng.random(n) < 0.2] = 0
    delta[:3] = [1e-40, -1e-42, 0.0]  # subnormal deltas are ZERO
    codec = LC(bits=bits)
    _, ref = codec.encode_delta(np.zeros(n, np.float32), None)
    data, ref = codec.encode_delta(delta, ref)
    assert np.array_equal(ref.array, oracle(delta, bits, "midrange"))
    nonzero = np.unique(ref.array[ref.array != 0])
    assert len(nonzero) == 2**bits - 1  # exactly the kept buckets' representatives
    assert len(data) < delta.nbytes / 4


def test_mean_representative_is_the_bucket_mean() -> None:
    rng = np.random.default_rng(7)
    delta = (rng.standard_normal(4000) * 1e-2).astype(np.float32)
    codec = LC(bits=3, rep="mean")
    _, ref = codec.encode_delta(np.zeros_like(delta), None)
    _, ref = codec.encode_delta(delta, ref)
    expected = oracle(delta, 3, "mean")
    assert np.allclose(ref.array, expected, rtol=2e-7, atol=0)
    assert np.array_equal(ref.array != 0, expected != 0)


def test_approximate_tracking_keeps_the_error_from_piling_up() -> None:
    """Deltas against the reconstruction carry quantization error forward instead of summing it;
    quantizing deltas against the true previous state drifts."""
    rng = np.random.default_rng(3)
    n, steps = 20_000, 60
    u = rng.standard_normal(n).astype(np.float32)
    codec = LC(bits=2, full_every=1000)
    _, tracked = codec.encode_delta(u, None)
    naive = u.copy()
    drift_tracked, drift_naive = [], []
    for _ in range(steps):
        step = (rng.standard_normal(n) * 1e-3 + 2e-4).astype(np.float32)  # a consistent trend
        previous, u = u, (u + step).astype(np.float32)
        _, tracked = codec.encode_delta(u, tracked)
        _, one = LC(bits=2).encode_delta(previous, None)
        _, one = LC(bits=2).encode_delta(u, one)
        naive += one.array - previous  # naive: sum of quantized true deltas
        drift_tracked.append(float(np.abs(tracked.array - u).max()))
        drift_naive.append(float(np.abs(naive - u).max()))
    bound = float(np.abs(step).max()) * 3
    assert max(drift_tracked) < bound
    assert drift_naive[-1] > 5 * max(drift_tracked[-10:])


def test_each_error_is_at_most_the_delta_it_quantizes() -> None:
    rng = np.random.default_rng(11)
    r = rng.standard_normal(50_000)
    u = r + rng.standard_t(3, r.size) * 1e-3
    for dtype in (np.float32, np.float64):
        ur, rr = u.astype(dtype), r.astype(dtype)
        codec = LC(bits=3)
        _, ref = codec.encode_delta(rr, None)
        _, ref = codec.encode_delta(ur, ref)
        before = np.abs(ur.astype(np.float64) - rr)
        after = np.abs(ur.astype(np.float64) - ref.array)
        assert np.all(after <= before + np.spacing(np.abs(ref.array)).astype(np.float64))


def test_all_zero_delta_costs_a_few_bytes_and_changes_nothing() -> None:
    a = np.random.default_rng(0).standard_normal((300, 300)).astype(np.float32)
    codec = LC()
    _, ref = codec.encode_delta(a, None)
    data, ref = codec.encode_delta(a.copy(), ref)
    assert len(data) < 64
    assert ref.array.tobytes() == a.tobytes()
    decoded = codec.decode_delta(bytes(data), a.dtype, a.shape, Reference(a.copy()))
    assert decoded.array.tobytes() == a.tobytes()


def test_empty_tensors_round_trip() -> None:
    for shape in [(0,), (3, 0), (0, 5, 2)]:
        a = np.zeros(shape, np.float32)
        codec = LC()
        data, ref = codec.encode_delta(a, None)
        data2, ref = codec.encode_delta(a, ref)
        first = codec.decode_delta(bytes(data), a.dtype, shape, None)
        out = codec.decode_delta(bytes(data2), a.dtype, a.shape, first)
        assert out.array.shape == shape


def test_the_code_table_is_reused_while_the_distribution_is_stable() -> None:
    rng = np.random.default_rng(5)
    u = rng.standard_normal(200_000).astype(np.float32)
    codec = LC(bits=3)
    _, ref = codec.encode_delta(u, None)
    dec = Reference(u.copy())
    sizes, tables = [], []
    for scale in (1e-3, 1e-3, 1e-3, 1e-3):
        u = (u + rng.standard_normal(u.size).astype(np.float32) * np.float32(scale)).astype(np.float32)
        data, ref = codec.encode_delta(u, ref)
        dec = codec.decode_delta(bytes(data), u.dtype, u.shape, dec)
        sizes.append(len(data))
        tables.append(ref.memo)
        assert dec.memo is not None and np.array_equal(dec.memo.lengths, ref.memo.lengths)  # type: ignore[attr-defined]
    assert tables[1] is tables[0] and tables[3] is tables[0]  # same cached table object, not rebuilt
    sparse = u.copy()
    sparse[: u.size // 2] += np.float32(1.0)  # a very different symbol distribution
    _, ref = codec.encode_delta(sparse, ref)
    assert ref.memo is not tables[0]


def test_tensors_larger_than_a_block_use_bounded_memory() -> None:
    """Temporary memory does not grow with the tensor: 8 blocks peak like 2 blocks."""
    rng = np.random.default_rng(1)
    peaks = {}
    for blocks in (2, 8):
        n = blocks * BLOCK + 12_345
        r = rng.standard_normal(n).astype(np.float32)
        u = r + (rng.standard_normal(n) * 1e-3 * (rng.random(n) < 0.3)).astype(np.float32)
        codec = LC(bits=3)
        ref = Reference(r.copy())
        tracemalloc.start()
        data, ref = codec.encode_delta(u, ref)
        enc_peak = tracemalloc.get_traced_memory()[1] - len(data)
        tracemalloc.stop()
        dec = Reference(r)
        tracemalloc.start()
        dec = codec.decode_delta(data, u.dtype, u.shape, dec)
        dec_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert dec.array.tobytes() == ref.array.tobytes()
        peaks[blocks] = (enc_peak, dec_peak)
    slack = 8 << 20
    assert peaks[8][0] < peaks[2][0] + slack, peaks
    assert peaks[8][1] < peaks[2][1] + slack, peaks
    assert peaks[8][0] < 4 * BLOCK * 4 * 8  # well under the 8-block tensor's size x4


@pytest.mark.parametrize("dtype", [np.float16, np.uint16])
def test_half_precision_computes_in_float32_and_stays_in_its_type(dtype: Any) -> None:
    rng = np.random.default_rng(2)
    f = rng.standard_normal(10_000).astype(np.float32)
    g = f + rng.standard_normal(f.size).astype(np.float32) * np.float32(0.05)
    if dtype == np.uint16:  # bfloat16 bits
        a, b = (f.view(np.uint32) >> 16).astype(np.uint16), (g.view(np.uint32) >> 16).astype(np.uint16)
        as_f32 = lambda x: (x.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
    else:
        a, b = f.astype(np.float16), g.astype(np.float16)
        as_f32 = lambda x: x.astype(np.float32)  # noqa: E731
    codec = LC(bits=3)
    _, ref = codec.encode_delta(a, None)
    data, ref = codec.encode_delta(b, ref)
    assert ref.array.dtype == dtype
    err_after = np.abs(as_f32(ref.array) - as_f32(b))
    err_before = np.abs(as_f32(a) - as_f32(b))
    assert err_after.mean() < 0.5 * err_before.mean()
    assert len(data) < b.nbytes / 2


def test_every_full_every_th_save_is_full() -> None:
    """full_every is honoured by whoever keeps the chain; a full payload resets the reference."""
    from crashsafe.codecs.lc import MAGIC

    a = np.ones(1000, np.float32)
    codec = LC(full_every=3)
    full = bytes(codec.encode(a))
    assert full[: len(MAGIC)] == MAGIC and full[len(MAGIC) + 1] == 0  # kind byte: full
    _, ref = codec.encode_delta(a, None)
    delta, _ = codec.encode_delta(a * 2, ref)
    assert bytes(delta)[len(MAGIC) + 1] == 1
