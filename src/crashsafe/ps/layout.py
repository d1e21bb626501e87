"""Key space of a model: tables of rows, cut into blocks (the unit of versioning and
replication), and blocks cut into contiguous key ranges, one per server."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = ["BlockLayout", "TableSpec", "ranges_index"]

Ints = NDArray[np.int64]
_RECENT = 16  # block sets whose rows BlockLayout remembers


@dataclass(frozen=True)
class TableSpec:
    """A parameter table: ``rows`` keys of ``dim`` float32 values, versioned in blocks of ``block_rows``."""

    name: str
    rows: int
    dim: int
    block_rows: int


class BlockLayout:
    """Global block ids, table by table; server ``s`` owns the contiguous range ``ranges[s]``."""

    def __init__(self, tables: list[TableSpec], servers: int) -> None:
        self.tables = tables
        self.names = [t.name for t in tables]
        starts: list[int] = []
        table_of: list[int] = []
        row_lo: list[int] = []
        row_hi: list[int] = []
        for ti, t in enumerate(tables):
            starts.append(len(table_of))
            for lo in range(0, t.rows, t.block_rows):
                table_of.append(ti)
                row_lo.append(lo)
                row_hi.append(min(lo + t.block_rows, t.rows))
        self.first_block = np.array(starts, dtype=np.int64)
        self.table_of = np.array(table_of, dtype=np.int64)
        self.row_lo = np.array(row_lo, dtype=np.int64)
        self.row_hi = np.array(row_hi, dtype=np.int64)
        self.n_blocks = len(table_of)
        if servers > self.n_blocks:
            raise ValueError(f"{servers} servers but the model has only {self.n_blocks} blocks")
        bounds = np.linspace(0, self.n_blocks, servers + 1).round().astype(np.int64)
        self.ranges = [(int(bounds[s]), int(bounds[s + 1])) for s in range(servers)]
        self.server_of = np.repeat(np.arange(servers, dtype=np.int64), np.diff(bounds))
        self._recent: dict[tuple[str, bytes], list[tuple[int, Ints]]] = {}  # block set -> rows (_runs)

    def blocks_of_rows(self, table: int, rows: Ints) -> Ints:
        """Global block id of each row of ``table``."""
        out: Ints = self.first_block[table] + rows // self.tables[table].block_rows
        return out

    def rows_in(self, table: int, lo: int, hi: int) -> tuple[int, int]:
        """Row range ``[first, last)`` of ``table`` covered by global blocks ``[lo, hi)``."""
        mine = np.flatnonzero(self.table_of[lo:hi] == table) + lo
        if mine.size == 0:
            return 0, 0
        return int(self.row_lo[mine[0]]), int(self.row_hi[mine[-1]])

    def _runs(self, blocks: Ints) -> list[tuple[int, Ints]]:
        """Per table (ascending), the rows of ``blocks`` (ascending global ids) in order.

        Remembered for the last few block sets: a dense model pulls the same blocks every clock,
        and a pull gathers values and each optimizer state over them."""
        key = (blocks.dtype.str, blocks.tobytes())
        out = self._recent.get(key)
        if out is None:
            out = []
            tables = self.table_of[blocks]
            one = blocks.size > 0 and tables[0] == tables[-1]  # ascending blocks: all in one table
            for ti in [int(tables[0])] if one else np.unique(tables).tolist():
                mine = blocks if one else blocks[tables == ti]
                rows = ranges_index(self.row_lo[mine], self.row_hi[mine] - self.row_lo[mine])
                rows.flags.writeable = False  # shared by later calls
                out.append((ti, rows))
            if len(self._recent) >= _RECENT:
                del self._recent[next(iter(self._recent))]
            self._recent[key] = out
        return out

    def gather(
        self, arrays: list[NDArray[np.float32]], bases: list[int], blocks: Ints
    ) -> NDArray[np.float32]:
        """Concatenate the rows of ``blocks`` (ascending) from per-table arrays starting at row ``bases``."""
        parts = [arrays[ti][rows - bases[ti]].ravel() for ti, rows in self._runs(blocks)]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def scatter(
        self, flat: NDArray[np.float32], arrays: list[NDArray[np.float32]], bases: list[int], blocks: Ints
    ) -> None:
        """Inverse of :meth:`gather`: write ``flat`` back into the per-table arrays."""
        at = 0
        for ti, rows in self._runs(blocks):
            n = rows.size * self.tables[ti].dim
            arrays[ti][rows - bases[ti]] = flat[at : at + n].reshape(rows.size, self.tables[ti].dim)
            at += n

    def block_elems(self, blocks: Ints) -> Ints:
        """Number of float values in each block."""
        dims = np.array([t.dim for t in self.tables], np.int64)
        out: Ints = (self.row_hi[blocks] - self.row_lo[blocks]) * dims[self.table_of[blocks]]
        return out


def ranges_index(starts: Ints, lengths: Ints) -> Ints:
    """Concatenation of ``arange(s, s + n)`` for each start ``s`` and length ``n``, vectorized."""
    total = int(lengths.sum())
    offsets = np.cumsum(lengths) - lengths
    out: Ints = np.arange(total, dtype=np.int64) + np.repeat(starts - offsets, lengths)
    return out
