"""The entropy stage: zero-run tokens and the vectorized canonical Huffman coder."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crashsafe.codecs import zeroruns
from crashsafe.codecs._frame import FrameReader, FrameWriter
from crashsafe.codecs.huffman import LANE, MAX_LEN, HuffmanTable, read_stream, write_stream
from crashsafe.errors import CodecError


def roundtrip(table: HuffmanTable, tokens: np.ndarray[Any, Any], extra: np.ndarray[Any, Any]) -> bytes:
    out = FrameWriter(b"T")
    write_stream(out, table, tokens, extra)
    data = out.getvalue()
    got_tokens, got_extra = read_stream(FrameReader(data, b"T", "test"), table, tokens.size)
    assert np.array_equal(got_tokens, tokens)
    assert np.array_equal(got_extra, extra)
    return data


@pytest.mark.timeout(60)
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    count=st.sampled_from([1, 2, 7, LANE - 1, LANE, LANE + 1, 2 * LANE, 3 * LANE + 17]),
    alphabet=st.integers(1, 400),
    skew=st.floats(0.1, 3.0),
)
def test_random_token_streams_round_trip(seed: int, count: int, alphabet: int, skew: float) -> None:
    rng = np.random.default_rng(seed)
    weights = rng.random(alphabet) ** (1 / skew)
    tokens = rng.choice(alphabet, size=count, p=weights / weights.sum()).astype(np.int64)
    extra_len = rng.integers(0, 46, alphabet).astype(np.int64) * (rng.random(alphabet) < 0.5)
    extra = rng.integers(0, 2**62, count, dtype=np.int64) & ((np.int64(1) << extra_len[tokens]) - 1)
    table = HuffmanTable.build(np.bincount(tokens, minlength=alphabet), extra_len)
    roundtrip(table, tokens, extra)


def test_code_lengths_are_limited_and_prefix_free() -> None:
    fib = [1, 1]
    while len(fib) < 40:
        fib.append(fib[-1] + fib[-2])  # the classic worst case for code length
    freq = np.array(fib, dtype=np.int64)
    table = HuffmanTable.build(freq, np.zeros(freq.size, dtype=np.int64))
    assert table.lengths.max() == MAX_LEN
    assert np.sum(np.ldexp(1.0, -table.lengths)) <= 1.0
    codes = [format(int(c), f"0{int(n)}b")[::-1] for c, n in zip(table.codes, table.lengths, strict=True)]
    for i, a in enumerate(codes):
        for j, b in enumerate(codes):
            assert i == j or not b.startswith(a), "a code is the prefix of another"
    rng = np.random.default_rng(0)
    tokens = rng.choice(freq.size, size=5000, p=freq / freq.sum()).astype(np.int64)
    roundtrip(table, tokens, np.zeros_like(tokens))


@pytest.mark.parametrize("p0", [0.3, 0.7, 0.9, 0.99])
@pytest.mark.parametrize("nsym", [3, 7])
def test_zero_run_huffman_is_within_3_percent_of_the_order0_entropy(p0: float, nsym: int) -> None:
    """On i.i.d. symbols (no structure to exploit) the stage stays within 3% of the entropy,
    table included; a per-symbol Huffman code would need >= 1 bit per symbol."""
    rng = np.random.default_rng(int(p0 * 1000) + nsym)
    n = 1 << 19
    probs = np.r_[p0, (1 - p0) * np.linspace(2, 0.2, nsym) / np.linspace(2, 0.2, nsym).sum()]
    symbols = rng.choice(nsym + 1, size=n, p=probs)
    freq = np.bincount(symbols) / n
    entropy = -np.sum(freq[freq > 0] * np.log2(freq[freq > 0])) * n
    pos = np.flatnonzero(symbols)
    tokens, extra = zeroruns.to_tokens(pos, symbols[pos], nsym)
    extras = zeroruns.alphabet(n, nsym)
    table = HuffmanTable.build(np.bincount(tokens, minlength=extras.size), extras)
    bits = 8 * (len(roundtrip(table, tokens, extra)) + len(table.to_bytes()))
    assert bits <= 1.03 * entropy


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    length=st.integers(1, 1 << 21),
    density=st.floats(0.0, 1.0),
    nsym=st.integers(1, 7),
)
def test_zero_run_tokens_round_trip(seed: int, length: int, density: float, nsym: int) -> None:
    rng = np.random.default_rng(seed)
    count = min(length, int(rng.binomial(min(length, 5000), density)))
    pos = np.sort(rng.choice(length, size=count, replace=False)).astype(np.int64)
    vals = rng.integers(1, nsym + 1, count)
    tokens, extra = zeroruns.to_tokens(pos, vals, nsym)
    extras = zeroruns.alphabet(length, nsym)
    assert np.all(tokens < extras.size)
    assert np.all(extra < (np.int64(1) << extras[tokens]))
    back_pos, back_vals = zeroruns.from_tokens(tokens, extra, nsym, length)
    assert np.array_equal(back_pos, pos) and np.array_equal(back_vals, vals)


def test_damaged_streams_and_tables_are_refused() -> None:
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, 50, 3 * LANE + 5).astype(np.int64)
    extra_len = np.zeros(50, dtype=np.int64)
    table = HuffmanTable.build(np.bincount(tokens, minlength=50), extra_len)
    data = roundtrip(table, tokens, np.zeros_like(tokens))
    with pytest.raises(CodecError):  # truncated
        read_stream(FrameReader(data[:-3], b"T", "test"), table, tokens.size)
    with pytest.raises(CodecError):  # more tokens than the caller allows
        read_stream(FrameReader(data, b"T", "test"), table, tokens.size - 1)
    lanes = bytearray(data)
    lanes[1 + 8] ^= 0x40  # first lane offset (after count and nbits) points elsewhere
    with pytest.raises(CodecError, match="damaged"):
        read_stream(FrameReader(bytes(lanes), b"T", "test"), table, tokens.size)
    with pytest.raises(CodecError, match="prefix code"):
        HuffmanTable(np.array([1, 1, 1]), np.zeros(3, dtype=np.int64))
    with pytest.raises(CodecError):
        HuffmanTable.from_bytes(memoryview(b"\xff\xff\x00\x00garbage"), extra_len)


def test_a_table_round_trips_through_bytes_and_keeps_unseen_tokens_codable() -> None:
    freq = np.array([500, 0, 30, 0, 0, 7, 0, 0], dtype=np.int64)
    extras = np.zeros(8, dtype=np.int64)
    table = HuffmanTable.build(freq, extras)
    again = HuffmanTable.from_bytes(memoryview(table.to_bytes()), extras)
    assert np.array_equal(again.lengths, table.lengths)
    assert table.cost(np.array([1, 1, 1, 1, 1, 1, 0, 0])) is not None  # unseen tokens below the top
    assert table.cost(np.array([0, 0, 0, 0, 0, 0, 0, 1])) is None  # beyond the largest seen token
    assert table.lengths[0] < table.lengths[1]  # seen tokens get the short codes
