"""Canonical Huffman coding of token streams, vectorized with numpy (no per-symbol Python loop).

A table is just each token's code length (canonical codes follow from the lengths), limited to
``MAX_LEN`` bits. Codes are written LSB-first, as in DEFLATE, each followed by the token's raw
"extra" bits (their count is fixed per token). Encoding is a cumulative sum of code lengths plus
an OR-reduction into 64-bit words. Decoding is inherently sequential within a stream, so the
encoder records where every ``LANE``-th token starts and the decoder advances all lanes at once,
one table lookup per lane per numpy step.
"""

from __future__ import annotations

import heapq
from functools import cached_property
from typing import Any

import numpy as np
import zstandard

from crashsafe.codecs._frame import FrameReader, FrameWriter
from crashsafe.errors import CodecError

__all__ = ["LANE", "MAX_LEN", "HuffmanTable", "read_stream", "write_stream"]

MAX_LEN = 15
LANE = 1024
_BAD = 0xFFFF
_SEEN_WEIGHT = 10  # a seen token weighs 2**10 unseen ones when codes are assigned
_ZSTD_TABLE = 1 << 15


def _reversal_table() -> np.ndarray[Any, Any]:
    x = np.arange(1 << 16, dtype=np.int64)
    rev = np.zeros_like(x)
    for bit in range(16):
        rev |= ((x >> bit) & 1) << (15 - bit)
    return rev


_REV16 = _reversal_table()


def _limited_lengths(freq: np.ndarray[Any, Any], used: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Huffman code lengths of the ``used`` symbols, then limited to MAX_LEN (JPEG Annex K.3)."""
    n = used.size
    counts = freq[used].tolist()
    heap = [(c, i) for i, c in enumerate(counts)]
    heapq.heapify(heap)
    parent = [0] * (2 * n - 1)
    nxt = n
    while len(heap) > 1:
        fa, a = heapq.heappop(heap)
        fb, b = heapq.heappop(heap)
        parent[a] = parent[b] = nxt
        heapq.heappush(heap, (fa + fb, nxt))
        nxt += 1
    depth = [0] * (2 * n - 1)
    for node in range(2 * n - 3, -1, -1):
        depth[node] = depth[parent[node]] + 1
    lengths = np.array(depth[:n], dtype=np.int64)
    if lengths.max() <= MAX_LEN:
        return lengths
    bits = np.bincount(lengths).tolist()
    for i in range(len(bits) - 1, MAX_LEN, -1):
        while bits[i] > 0:
            j = i - 2
            while bits[j] == 0:
                j -= 1
            bits[i] -= 2
            bits[i - 1] += 1
            bits[j + 1] += 2
            bits[j] -= 1
    by_weight = np.lexsort((np.arange(n), -np.asarray(counts)))
    limited = np.empty(n, dtype=np.int64)
    limited[by_weight] = np.repeat(np.arange(len(bits)), bits)
    return limited


class HuffmanTable:
    """Code lengths of an alphabet of tokens, plus each token's count of extra bits.

    Derived arrays (codes, the decoding table) are computed once per table and cached on it, so a
    table reused across blocks and saves is never rebuilt.
    """

    def __init__(self, lengths: np.ndarray[Any, Any], extra: np.ndarray[Any, Any]) -> None:
        if lengths.shape != extra.shape:
            raise CodecError("Huffman table does not fit its alphabet")
        self.lengths = lengths.astype(np.int64)
        self.extra = extra.astype(np.int64)
        used = self.lengths[self.lengths > 0]
        if used.size == 0 or used.max() > MAX_LEN or np.sum(np.ldexp(1.0, -used)) > 1.0:
            raise CodecError("Huffman table is not a valid prefix code")

    @classmethod
    def build(cls, freq: np.ndarray[Any, Any], extra: np.ndarray[Any, Any]) -> HuffmanTable:
        """A length-limited Huffman table for token frequencies ``freq`` (at least one > 0).

        Unseen tokens below the largest seen one get a long code too (weight 1/1024 of a seen
        token's), so the table stays usable for the next saves' streams at ~1% of code space.
        """
        top = int(np.flatnonzero(freq)[-1]) + 1
        weights = np.zeros(freq.size, dtype=np.int64)
        weights[:top] = np.where(freq[:top] > 0, freq[:top] << _SEEN_WEIGHT, 1)
        used = np.flatnonzero(weights)
        lengths = np.zeros(freq.size, dtype=np.int64)
        lengths[used] = 1 if used.size == 1 else _limited_lengths(weights, used)
        return cls(lengths, extra)

    def cost(self, freq: np.ndarray[Any, Any]) -> int | None:
        """Code bits for tokens with frequencies ``freq``, or None if one has no code here."""
        if freq.size != self.lengths.size or np.any((freq > 0) & (self.lengths == 0)):
            return None
        return int(freq @ self.lengths)

    @cached_property
    def codes(self) -> np.ndarray[Any, Any]:
        """Bit-reversed canonical codes (ready for an LSB-first stream)."""
        order = np.lexsort((np.arange(self.lengths.size), self.lengths))
        order = order[self.lengths[order] > 0]
        lens = self.lengths[order]
        codes = np.zeros(self.lengths.size, dtype=np.int64)
        code = 0
        previous = int(lens[0])
        canonical = []
        for length in lens.tolist():
            code <<= length - previous
            previous = length
            canonical.append(code)
            code += 1
        codes[order] = _REV16[np.asarray(canonical, dtype=np.int64)] >> (16 - lens)
        return codes

    @cached_property
    def maxlen(self) -> int:
        return int(self.lengths.max())

    @cached_property
    def lut(self) -> np.ndarray[Any, Any]:
        """Next ``maxlen`` stream bits -> token | code length << 16 | code+extra length << 24."""
        lut = np.full(1 << self.maxlen, _BAD, dtype=np.int32)  # entries fit in 30 bits
        tokens = np.flatnonzero(self.lengths)
        lengths = self.lengths[tokens]
        copies = np.int64(1) << (self.maxlen - lengths)  # a code fills every index ending in it
        first = np.cumsum(copies) - copies
        nth = np.arange(int(copies.sum()), dtype=np.int64) - np.repeat(first, copies)
        index = np.repeat(self.codes[tokens], copies) | (nth << np.repeat(lengths, copies))
        entries = tokens | (lengths << 16) | ((lengths + self.extra[tokens]) << 24)
        lut[index] = np.repeat(entries, copies).astype(np.int32)
        return lut

    def to_bytes(self) -> bytes:
        """Code lengths as nibbles up to the last coded token, zstd-compressed when that is smaller.

        Layout: u16 count of nibbles (bit 15 set: zstd), then the nibbles.
        """
        used = int(np.flatnonzero(self.lengths)[-1]) + 1
        nibbles = np.zeros(used + used % 2, dtype=np.uint8)
        nibbles[:used] = self.lengths[:used]
        packed = (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()
        squeezed = zstandard.ZstdCompressor(level=9, write_content_size=False).compress(packed)
        if len(squeezed) < len(packed):
            return (used | _ZSTD_TABLE).to_bytes(2, "little") + squeezed
        return used.to_bytes(2, "little") + packed

    @classmethod
    def from_bytes(cls, data: memoryview, extra: np.ndarray[Any, Any]) -> HuffmanTable:
        head = int.from_bytes(data[:2], "little")
        used = head & ~_ZSTD_TABLE
        size = (used + 1) // 2
        if not 0 < used <= extra.size or len(data) < 2:
            raise CodecError("Huffman table has a damaged size")
        packed = bytes(data[2:])
        if head & _ZSTD_TABLE:
            try:
                with zstandard.ZstdDecompressor().stream_reader(packed) as reader:
                    packed = reader.read(size + 1)  # never more than a valid table needs
            except zstandard.ZstdError as exc:
                raise CodecError(f"Huffman table does not decompress: {exc}") from None
        if len(packed) != size:
            raise CodecError("Huffman table has a damaged size")
        raw = np.frombuffer(packed, dtype=np.uint8)
        lengths = np.zeros(extra.size, dtype=np.int64)
        lengths[:used] = np.stack([raw & 15, raw >> 4], axis=1).reshape(-1)[:used]
        return cls(lengths, extra)


def write_stream(out: FrameWriter, table: HuffmanTable, tokens: np.ndarray[Any, Any],
                 extra: np.ndarray[Any, Any]) -> None:
    """Append ``len(tokens) > 0`` tokens (with their extra bits) as a lane-indexed bit stream."""
    code_len = table.lengths[tokens]
    total = code_len + table.extra[tokens]
    value = table.codes[tokens] | (extra << code_len)
    ends = np.cumsum(total)
    pos = ends - total
    nbits = int(ends[-1])
    word = pos >> 6
    shift = pos & 63
    starts = np.flatnonzero(np.concatenate(([True], word[1:] != word[:-1])))
    words = np.zeros(nbits // 64 + 2, dtype=np.int64)
    first = word[starts]
    words[first] = np.bitwise_or.reduceat(value << shift, starts)
    words[first + 1] |= np.bitwise_or.reduceat((value >> 1) >> (63 - shift), starts)
    count = tokens.size
    lanes = np.minimum(np.arange(0, count, LANE), max(count - LANE, 0))
    out.u32(count)
    out.u32(nbits)
    out.array(np.diff(pos[lanes]).astype(np.uint16))
    out.array(words.view(np.uint8)[: (nbits + 7) // 8])


def read_stream(
    src: FrameReader, table: HuffmanTable, max_count: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Inverse of :func:`write_stream`: (tokens, extra bits), both int64; at most ``max_count``."""
    count = src.u32()
    nbits = src.u32()
    nlanes = -(-count // LANE)
    if not 0 < count <= min(max_count, nbits) or nbits > (MAX_LEN + int(table.extra.max())) * count:
        raise CodecError(f"{src.what} payload has a damaged token stream header")
    starts = np.zeros(nlanes, dtype=np.int64)
    np.cumsum(src.array(np.uint16, nlanes - 1), out=starts[1:])
    nbytes = (nbits + 7) // 8
    padded = np.zeros(nbytes + 16, dtype=np.uint8)
    padded[:nbytes] = src.array(np.uint8, nbytes)
    windows = np.ndarray((nbytes + 9,), dtype="<i8", buffer=padded, strides=(1,)).copy()
    by_byte = np.empty((nbytes + 1, 8), dtype=np.int32)
    mask = (1 << table.maxlen) - 1
    for bit in range(8):
        by_byte[:, bit] = (windows[: nbytes + 1] >> bit) & mask
    peek: np.ndarray[Any, Any] = by_byte.reshape(-1)  # peek[p]: the next maxlen bits at bit p
    steps = min(count, LANE)
    lut = table.lut
    pos = starts.astype(np.int32)
    tmp = np.empty(nlanes, dtype=np.int32)
    window = np.empty(nlanes, dtype=np.int32)
    entries = np.empty((steps, nlanes), dtype=np.int32)
    for i in range(steps):
        peek.take(pos, out=window, mode="clip")
        row = entries[i]
        lut.take(window, out=row, mode="clip")
        np.right_shift(row, 24, out=tmp)
        np.add(pos, tmp, out=pos)
    ends_ok = pos[-1] == nbits and np.array_equal(pos[:-2], starts[1:-1])
    if count == nlanes * steps and nlanes > 1:
        ends_ok = ends_ok and pos[-2] == starts[-1]
    lanes = entries.T
    tail = count - (nlanes - 1) * steps
    flat = np.concatenate((lanes[:-1].reshape(-1), lanes[-1, steps - tail :])).astype(np.int64)
    tokens = flat & 0xFFFF
    if not ends_ok or np.any(tokens == _BAD):
        raise CodecError(f"{src.what} payload has a damaged Huffman bit stream")
    extra = np.zeros(count, dtype=np.int64)
    xl = table.extra[tokens]
    has = np.flatnonzero(xl)
    if has.size:
        offsets = np.zeros((steps, nlanes), dtype=np.int64)
        np.cumsum(entries[:-1] >> 24, axis=0, dtype=np.int64, out=offsets[1:])
        offsets += starts
        at = offsets.T
        tok_pos = np.concatenate((at[:-1].reshape(-1), at[-1, steps - tail :]))[has]
        p = tok_pos + ((flat[has] >> 16) & 0xFF)
        bits = np.take(windows, p >> 3, mode="clip") >> (p & 7)
        extra[has] = bits & ((np.int64(1) << xl[has]) - 1)
    return tokens, extra
