"""Baselines for LC-checkpoint at a fixed byte budget: SCAR-style partial and TOP-N checkpoints.

Both keep the reconstruction a restore would see (each element's value as last saved) and, at
each save, store exactly the parts that moved furthest from it, as many as ``budget`` (a fraction
of the tensor's full size, indices included) allows. Unspent budget carries over to the next save
(up to one unit), so a row larger than one save's budget is still saved every few saves and the
average size per save stays at the budget:

- :class:`Scar` (Qiao et al., ICML 2019, "prioritized checkpoints"): whole parameter blocks —
  rows of the tensor, as a parameter server shards them — ranked by the norm of their change.
- :class:`TopN`: single elements ranked by ``|change|``, each with its index.

Changes that are not finite rank first and are stored exactly, like any other value.
"""

from __future__ import annotations

import math
import reprlib
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from crashsafe.codecs._delta import FloatDeltaCodec
from crashsafe.codecs._floats import FloatFormat
from crashsafe.codecs._frame import FrameReader, FrameWriter
from crashsafe.codecs.base import Reference
from crashsafe.codecs.registry import register_codec
from crashsafe.errors import CodecError

__all__ = ["Scar", "TopN"]

_CHUNK = 1 << 20  # elements scored at once


@dataclass(frozen=True)
class _Partial(FloatDeltaCodec):
    """Shared machinery: rank rows of the tensor by change, store the top ones exactly."""

    budget: float = 0.05
    full_every: int = 100

    def _check_parameters(self) -> None:
        budget = self.budget
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1:
            got = reprlib.repr(budget)
            raise ValueError(f"{self.codec_id} budget must be a fraction in (0, 1], got {got}")

    @abstractmethod
    def _row_length(self, shape: tuple[int, ...]) -> int:
        """Elements per ranked unit (a row for SCAR, one element for TOP-N) of a non-empty tensor."""

    def _rows(self, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return array.reshape(-1, self._row_length(array.shape)) if array.size else array.reshape(0, 1)

    def _encode_change(
        self, array: np.ndarray[Any, Any], reference: Reference, fmt: FloatFormat, out: FrameWriter
    ) -> None:
        u = self._rows(array)
        r = reference.array.reshape(u.shape)
        index = _index_type(u.shape[0])
        unit = index.itemsize + u.shape[1] * array.dtype.itemsize
        credit = self.budget * array.nbytes + (reference.memo if isinstance(reference.memo, float) else 0.0)
        rows = _top_rows(u, r, fmt, int(credit // unit))
        reference.memo = min(credit - rows.size * unit, unit + self.budget * array.nbytes)
        out.u64(rows.size)
        out.array(rows.astype(index))
        out.array(u[rows])
        r[rows] = u[rows]

    def _decode_change(self, src: FrameReader, reference: Reference, fmt: FloatFormat) -> None:
        what = self.codec_id
        r = self._rows(reference.array)
        count = src.u64()
        if count > r.shape[0]:
            raise CodecError(f"{what} payload stores more rows than the tensor has")
        rows = src.array(_index_type(r.shape[0]), count).astype(np.int64)
        if count and (rows[-1] >= r.shape[0] or np.any(np.diff(rows) <= 0)):
            raise CodecError(f"{what} payload has damaged indices")
        r[rows] = src.array(reference.array.dtype, count * r.shape[1]).reshape(count, r.shape[1])


def _index_type(rows: int) -> np.dtype[Any]:
    """Row indices are u32 up to 2**32 rows, u64 beyond."""
    return np.dtype(np.uint32 if rows <= 1 << 32 else np.uint64)


def _top_rows(
    u: np.ndarray[Any, Any], r: np.ndarray[Any, Any], fmt: FloatFormat, count: int
) -> np.ndarray[Any, Any]:
    """Sorted indices of the ``count`` rows with the largest nonzero change (non-finite first)."""
    best_rows = np.empty(0, dtype=np.int64)
    best_score = np.empty(0, dtype=np.float64)
    if count == 0:
        return best_rows
    step = max(1, _CHUNK // max(u.shape[1], 1))
    for start in range(0, u.shape[0], step):
        with np.errstate(all="ignore"):  # inf - inf and overflow rank as non-finite: first
            d = fmt.delta(u[start : start + step], r[start : start + step]).astype(np.float64)
            score = np.square(d).sum(axis=1)
        score[~np.isfinite(score)] = np.inf
        moved = np.flatnonzero(score > 0)
        rows = np.concatenate((best_rows, moved + start))
        scores = np.concatenate((best_score, score[moved]))
        if rows.size > count:
            keep = _largest(scores, rows, count)
            rows, scores = rows[keep], scores[keep]
        best_rows, best_score = rows, scores
    return np.sort(best_rows)


def _largest(scores: np.ndarray[Any, Any], rows: np.ndarray[Any, Any], count: int) -> np.ndarray[Any, Any]:
    """Positions of the ``count`` largest scores, ties going to the lower row: the same choice on
    every machine (``argpartition`` leaves ties to its algorithm, which numpy picks by CPU)."""
    kth = np.partition(scores, scores.size - count)[scores.size - count]  # the count-th largest
    above = np.flatnonzero(scores > kth)
    tied = np.flatnonzero(scores == kth)
    tied = tied[np.argsort(rows[tied], kind="stable")][: count - above.size]
    return np.concatenate((above, tied))


@register_codec
@dataclass(frozen=True)
class Scar(_Partial):
    """SCAR prioritized partial checkpoint: the rows (first axis) that changed most, stored exactly."""

    codec_id = "scar"
    magic = b"CSSC"

    def _row_length(self, shape: tuple[int, ...]) -> int:
        return math.prod(shape[1:])


@register_codec
@dataclass(frozen=True)
class TopN(_Partial):
    """TOP-N: the elements whose change is largest, with their indices, stored exactly."""

    codec_id = "topn"
    magic = b"CSTN"

    def _row_length(self, shape: tuple[int, ...]) -> int:
        return 1
