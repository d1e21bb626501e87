"""LC-checkpoint (Chen et al., ICML 2020): lossy delta compression with approximate tracking.

Each save encodes ``delta = state - reconstruction`` (the reconstruction of the previous save, not
the true previous state, so quantization error is carried into the next delta instead of piling
up). Deltas are bucketed by (sign, exponent); priority promotion keeps the ``2**bits - 1`` buckets
of largest magnitude, each represented by one value (the bucket's midrange or mean), and maps all
other elements to ZERO. The symbols are coded as zero-run tokens with a canonical Huffman code
whose table is reused while it stays within 2% of optimal. Every ``full_every``-th save is a full,
lossless one. Non-finite values are never zeroed: such elements are stored exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from crashsafe.codecs import zeroruns
from crashsafe.codecs._delta import FloatDeltaCodec
from crashsafe.codecs._floats import FloatFormat
from crashsafe.codecs._frame import FrameReader, FrameWriter
from crashsafe.codecs.base import Reference, check_choice, check_int
from crashsafe.codecs.huffman import HuffmanTable, read_stream, write_stream
from crashsafe.codecs.registry import register_codec
from crashsafe.errors import CodecError

__all__ = ["LC"]

MAGIC = b"CSLC"
BLOCK = 1 << 20  # elements per block: one token stream each, bounds the tokens held at once
_LOG_BLOCKS = range(10, BLOCK.bit_length())  # block sizes a decoder takes: scratch stays bounded
_CHUNK = 1 << 16  # elements per elementwise step: temporaries stay in cache and get reused
_REPS = ("midrange", "mean")
_NO_TOKENS, _SAME_TABLE, _NEW_TABLE = 0, 1, 2
_STABLE = 1.02  # reuse a cached table while it costs at most 2% over the entropy bound


@dataclass(frozen=True)
class _Buckets:
    reps: np.ndarray[Any, Any]  # compute dtype, one per kept bucket (symbol i+1)
    symbol: np.ndarray[Any, Any]  # uint8 symbol of every (sign, exponent) key
    threshold: int  # smallest |delta| bit pattern that can be in a kept bucket
    nonfinite: bool  # some delta is inf or nan


@register_codec
@dataclass(frozen=True)
class LC(FloatDeltaCodec):
    """LC-checkpoint lossy delta codec for float tensors.

    Args:
        bits: 2 or 3; ``2**bits - 1`` buckets are kept (3 is the default, 2 compresses harder).
        rep: ``"midrange"`` ((max + min) / 2 of the bucket, as in the paper) or ``"mean"``.
        full_every: every ``full_every``-th save of a tensor is full and lossless.
    """

    codec_id = "lc"
    magic = MAGIC
    bits: int = 3
    rep: str = "midrange"
    full_every: int = 100

    def _check_parameters(self) -> None:
        check_int("lc", "bits", self.bits, 2, 3)
        check_choice("lc", "rep", self.rep, _REPS)

    # ------------------------------------------------------------------------------ encode

    def _encode_change(
        self, array: np.ndarray[Any, Any], reference: Reference, fmt: FloatFormat, out: FrameWriter
    ) -> None:
        u, r = array.reshape(-1), reference.array.reshape(-1)
        with np.errstate(all="ignore"):  # inf - inf, overflow: caught as exceptions, stored exactly
            buckets = self._buckets(u, r, fmt)
            k = buckets.reps.size
            for field in (self.bits, _REPS.index(self.rep), BLOCK.bit_length() - 1, k):
                out.u8(field)
            out.array(buckets.reps)
            extras = zeroruns.alphabet(min(BLOCK, u.size), k) if k else None
            table = reference.memo if isinstance(reference.memo, HuffmanTable) else None
            for start in range(0, u.size, BLOCK):
                ub, rb = u[start : start + BLOCK], r[start : start + BLOCK]
                pos, vals, exceptions = _quantize_block(ub, rb, buckets, fmt)
                if pos.size:
                    assert extras is not None
                    table = _write_tokens(out, pos, vals, k, extras, table)
                else:
                    out.u8(_NO_TOKENS)
                out.u32(exceptions.size)
                out.array(exceptions.astype(np.uint32))
                out.array(ub[exceptions])
        reference.memo = table

    def _buckets(self, u: np.ndarray[Any, Any], r: np.ndarray[Any, Any], fmt: FloatFormat) -> _Buckets:
        """Pass 1: per (sign, exponent) key the max and min |delta| (or the sum), then promotion."""
        nkeys = 2 * (fmt.exp_max + 1)
        top = np.zeros(nkeys, dtype=fmt.bits)
        inv_bottom = np.zeros(nkeys, dtype=fmt.bits)
        sums = np.zeros(nkeys, dtype=np.float64)
        counts = np.zeros(nkeys, dtype=np.int64)
        for start in range(0, u.size, _CHUNK):
            d = fmt.delta(u[start : start + _CHUNK], r[start : start + _CHUNK])
            dbits = d.view(fmt.bits)
            key = (dbits >> fmt.mantissa).astype(np.intp)
            np.maximum.at(top, key, dbits)
            np.maximum.at(inv_bottom, key, ~dbits)
            if self.rep == "mean":
                sums += np.bincount(key, weights=d, minlength=nkeys)
                counts += np.bincount(key, minlength=nkeys)
        keys = np.arange(nkeys)
        exponent = keys & fmt.exp_max
        present = top != 0
        nonfinite = bool(np.any(present & (exponent == fmt.exp_max)))
        eligible = np.flatnonzero(present & (exponent != 0) & (exponent != fmt.exp_max))
        if self.rep == "mean":
            rep = sums[eligible] / counts[eligible]
        else:
            hi = top[eligible].view(fmt.compute).astype(np.float64)
            lo = (~inv_bottom[eligible]).view(fmt.compute).astype(np.float64)
            rep = lo + (hi - lo) / 2
        kept = np.lexsort((eligible, -np.abs(rep)))[: (1 << self.bits) - 1]
        symbol = np.zeros(nkeys, dtype=np.uint8)
        symbol[eligible[kept]] = np.arange(1, kept.size + 1)
        threshold = int(exponent[eligible[kept]].min()) << fmt.mantissa if kept.size else 0
        return _Buckets(rep[kept].astype(fmt.compute), symbol, threshold, nonfinite)

    # ------------------------------------------------------------------------------ decode

    def _decode_change(self, src: FrameReader, reference: Reference, fmt: FloatFormat) -> None:
        src.expect(self.bits, src.u8(), "bits")
        src.expect(_REPS.index(self.rep), src.u8(), "rep")
        r = reference.array.reshape(-1)
        log_block = src.u8()
        k = src.u8()
        if log_block not in _LOG_BLOCKS or k >= 1 << self.bits:
            raise CodecError("lc payload has a damaged header")
        reps = src.array(fmt.compute, k)
        if not np.all(np.isfinite(reps)):
            raise CodecError("lc payload has non-finite bucket values")
        block = 1 << log_block
        extras = zeroruns.alphabet(min(block, r.size), k) if k else None
        table = reference.memo if isinstance(reference.memo, HuffmanTable) else None
        for start in range(0, r.size, block):
            rb = r[start : start + block]
            flag = src.u8()
            if flag != _NO_TOKENS:
                if extras is None:
                    raise CodecError("lc payload has tokens but no buckets")
                if flag == _NEW_TABLE:
                    table = HuffmanTable.from_bytes(src.blob(), extras)
                elif flag != _SAME_TABLE or table is None or table.lengths.size != extras.size:
                    raise CodecError("lc payload refers to a code table it does not have")
                tokens, extra = read_stream(src, table, rb.size)
                pos, vals = zeroruns.from_tokens(tokens, extra, k, rb.size)
                with np.errstate(all="ignore"):  # an overflow here is repaired by an exception below
                    rb[pos] = fmt.from_compute(fmt.to_compute(rb[pos]) + reps[vals - 1])
            count = src.u32()
            idx = src.array(np.uint32, count)
            if count and (idx[-1] >= rb.size or np.any(np.diff(idx.astype(np.int64)) <= 0)):
                raise CodecError("lc payload has damaged exception indices")
            rb[idx] = src.array(r.dtype, count)
        reference.memo = table


def _quantize_block(
    ub: np.ndarray[Any, Any], rb: np.ndarray[Any, Any], buckets: _Buckets, fmt: FloatFormat
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Pass 2 on one block: symbols (positions, values), exceptions; updates ``rb`` like a decoder."""
    absmask = fmt.bits.type(np.iinfo(fmt.bits).max >> 1)
    threshold = fmt.bits.type(buckets.threshold)
    k = buckets.reps.size
    positions, values, exceptions = [], [], []  # exceptions: overflowed or non-finite elements
    for start in range(0, ub.size, _CHUNK):
        uc, rc = ub[start : start + _CHUNK], rb[start : start + _CHUNK]
        d = fmt.delta(uc, rc)
        pos = vals = np.empty(0, dtype=np.int64)
        if k:
            dbits = d.view(fmt.bits)
            cand = np.flatnonzero((dbits & absmask) >= threshold)
            sym = buckets.symbol[dbits[cand] >> fmt.mantissa]
            hit = np.flatnonzero(sym)
            pos, vals = cand[hit], sym[hit]
            if pos.size:
                moved = fmt.from_compute(fmt.to_compute(rc[pos]) + buckets.reps[vals - 1])
                rc[pos] = moved
                overflow = pos[~fmt.isfinite(moved)]
                if overflow.size:
                    exceptions.append(overflow + start)
        if buckets.nonfinite:
            exceptions.append(np.flatnonzero(~np.isfinite(d)) + start)
        positions.append(pos + start)
        values.append(vals)
    exc = np.unique(np.concatenate(exceptions)) if exceptions else np.empty(0, dtype=np.int64)
    rb[exc] = ub[exc]
    return np.concatenate(positions), np.concatenate(values), exc


def _write_tokens(
    out: FrameWriter,
    pos: np.ndarray[Any, Any],
    vals: np.ndarray[Any, Any],
    k: int,
    extras: np.ndarray[Any, Any],
    table: HuffmanTable | None,
) -> HuffmanTable:
    """Code one block's symbols, reusing ``table`` while it stays near optimal; return the table used."""
    tokens, extra = zeroruns.to_tokens(pos, vals, k)
    freq = np.bincount(tokens, minlength=extras.size)
    old = table.cost(freq) if table is not None and table.lengths.size == extras.size else None
    if old is not None and old <= _STABLE * _entropy_bits(freq):
        out.u8(_SAME_TABLE)
    else:
        new = HuffmanTable.build(freq, extras)
        blob = new.to_bytes()
        new_cost = new.cost(freq)
        assert new_cost is not None
        if old is not None and old <= new_cost + 8 * (len(blob) + 8):
            out.u8(_SAME_TABLE)
        else:
            out.u8(_NEW_TABLE)
            out.blob(blob)
            table = new
    assert table is not None
    write_stream(out, table, tokens, extra)
    return table


def _entropy_bits(freq: np.ndarray[Any, Any]) -> float:
    f = freq[freq > 0].astype(np.float64)
    return float(np.sum(f * np.log2(f.sum() / f)))
