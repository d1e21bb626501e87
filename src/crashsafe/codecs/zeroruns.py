"""Zero-run tokens: a mostly-zero symbol stream as (run of zeros, next symbol) tokens.

LC symbols are ZERO for most elements (p(ZERO) is 0.7-0.999 on real training deltas), where a
per-symbol prefix code cannot go below 1 bit per element. Coding the run of zeros before each
nonzero symbol together with that symbol lets a Huffman code reach (and, on real data, beat) the
order-0 entropy. Runs below ``EXACT`` get their own class; longer runs share a class per quarter
octave and carry their low bits as raw extra bits, the way DEFLATE codes distances.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from crashsafe.errors import CodecError

__all__ = ["alphabet", "from_tokens", "to_tokens"]

EXACT = 16
_SUB = 2  # log2 of classes per octave


def _classes(max_run: int) -> int:
    octaves = max(0, max_run.bit_length() - 4)
    return EXACT + (octaves << _SUB)


def alphabet(length: int, nsym: int) -> np.ndarray[Any, Any]:
    """Extra-bit counts of every token for streams of ``length`` elements and ``nsym`` symbols."""
    cls = np.arange(_classes(max(length - 1, 0)), dtype=np.int64)
    octave = (cls - EXACT) >> _SUB
    extra = np.where(cls < EXACT, 0, octave + 4 - _SUB)
    return np.repeat(extra, nsym)


def to_tokens(
    positions: np.ndarray[Any, Any], values: np.ndarray[Any, Any], nsym: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Tokens and extra bits for nonzero ``values`` (1..nsym) at increasing ``positions``."""
    runs = np.diff(positions, prepend=-1) - 1
    cls = runs.copy()
    extra = np.zeros_like(runs)
    long = np.flatnonzero(runs >= EXACT)
    if long.size:
        r = runs[long]
        octave = np.frexp(r.astype(np.float64))[1].astype(np.int64) - 1
        low = octave - _SUB
        cls[long] = EXACT + ((octave - 4) << _SUB) + ((r >> low) & ((1 << _SUB) - 1))
        extra[long] = r & ((np.int64(1) << low) - 1)
    return cls * nsym + (values.astype(np.int64) - 1), extra


def from_tokens(
    tokens: np.ndarray[Any, Any], extra: np.ndarray[Any, Any], nsym: int, length: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(positions, values) back from tokens; raises if they point outside ``length`` elements."""
    cls, values = np.divmod(tokens, nsym)
    runs = cls.copy()
    long = np.flatnonzero(cls >= EXACT)
    if long.size:
        q = cls[long] - EXACT
        octave = (q >> _SUB) + 4
        runs[long] = (
            (np.int64(1) << octave) | ((q & ((1 << _SUB) - 1)) << (octave - _SUB)) | extra[long]
        )
    positions = np.cumsum(runs + 1) - 1
    if positions.size and positions[-1] >= length:
        raise CodecError("zero-run tokens point past the end of the block")
    return positions, values + 1
