"""Row-wise array operations of the refresh path, vectorised with numpy.

Mining works on ``[Q, K]`` matrices (Q training queries, K candidates, ``PAD`` where a row is
short): at MS MARCO size (~500k queries × 200-400 candidates) a Python loop per row costs
minutes per refresh, so every row operation here is a few whole-matrix numpy operations, run
over blocks of rows to bound the temporaries (:func:`row_blocks`). Each reproduces the
per-row code it replaced bit for bit (``tests/test_mining_vectorised.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

PAD = -1
# Bytes of one block's int64 [rows, width] matrix. Small enough for the allocator to reuse
# the same memory block after block (past its mmap threshold, up to 32 MiB, every temporary
# would be fresh pages, and page faults cost more than the arithmetic), large enough that
# the per-block Python overhead does not show: 1 MiB is ~300 rows of 400 candidates.
BLOCK_BYTES = 1 << 20


def row_blocks(rows: int, width: int, block_bytes: int = BLOCK_BYTES) -> Iterator[slice]:
    """Consecutive row ranges of about ``block_bytes`` of a ``[rows, width]`` int64 matrix."""
    step = max(1, block_bytes // max(1, 8 * width))
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


@dataclass(frozen=True)
class Positives:
    """Each query's positive documents in CSR form: row ``i`` holds the sorted, distinct
    documents ``indices[indptr[i]:indptr[i + 1]]``."""

    indptr: np.ndarray   # [Q + 1] int64
    indices: np.ndarray  # [nnz] int64

    @classmethod
    def from_rows(cls, rows: Sequence[Collection[int]]) -> Positives:
        """From one collection of documents per query (sets, lists; duplicates dropped)."""
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64,
                           count=int(lengths.sum()))
        row_of = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)
        order = np.lexsort((flat, row_of))
        flat, row_of = flat[order], row_of[order]
        distinct = np.ones(len(flat), dtype=bool)
        distinct[1:] = (flat[1:] != flat[:-1]) | (row_of[1:] != row_of[:-1])
        flat, row_of = flat[distinct], row_of[distinct]
        indptr = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(np.bincount(row_of, minlength=len(rows)), out=indptr[1:])
        return cls(indptr=indptr, indices=flat)

    def __len__(self) -> int:
        return len(self.indptr) - 1

    @property
    def counts(self) -> np.ndarray:
        """[Q] how many positives each row has."""
        return np.diff(self.indptr)

    def row(self, i: int) -> np.ndarray:
        return self.indices[self.indptr[i]:self.indptr[i + 1]]

    def dense(self, rows: slice) -> np.ndarray:
        """Rows ``rows`` as a ``[n, max count]`` matrix padded with PAD."""
        counts = self.counts[rows]
        width = int(counts.max(initial=0))
        out = np.full((len(counts), width), PAD, dtype=np.int64)
        if width:
            columns = np.arange(width)
            filled = columns[None, :] < counts[:, None]
            starts = self.indptr[:-1][rows]
            out[filled] = self.indices[(starts[:, None] + columns[None, :])[filled]]
        return out

    def owners(self) -> tuple[np.ndarray, Positives]:
        """Every document some row holds, ascending, and per document (same order) the
        rows that hold it, ascending: the transpose, without a row per absent document."""
        row_of = np.repeat(np.arange(len(self), dtype=np.int64), self.counts)
        order = np.lexsort((row_of, self.indices))
        docs, counts = np.unique(self.indices[order], return_counts=True)
        indptr = np.zeros(len(docs) + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        return docs, Positives(indptr=indptr, indices=row_of[order])

    def take(self, rows: np.ndarray) -> Positives:
        """The rows ``rows`` (in that order) as a CSR of their own."""
        rows = np.asarray(rows, dtype=np.int64)
        counts = self.counts[rows]
        indptr = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        within = np.arange(int(indptr[-1]), dtype=np.int64) - np.repeat(indptr[:-1], counts)
        return Positives(indptr=indptr,
                         indices=self.indices[np.repeat(self.indptr[:-1][rows], counts) + within])


def as_positives(positives: Positives | Sequence[Collection[int]]) -> Positives:
    return positives if isinstance(positives, Positives) else Positives.from_rows(positives)


def rowwise_lookup(values: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """For each ``values[i, j]``: the column of the *last* ``keys[i, :]`` equal to it, or -1
    (PAD keys never match, so neither does a PAD value).

    One sort per row of the keys and values together, each cell packed into one int64 as
    ``document, is_value, column`` (bit fields, high to low): a value sorts right after the
    keys equal to it, keys of one document in column order, so the last key before a value
    tells. Shifts and masks only (no division), and no boolean compaction."""
    rows, kv = values.shape
    kk = keys.shape[1]
    if rows == 0 or kv == 0 or kk == 0:
        return np.full((rows, kv), -1, dtype=np.int64)
    width = kk + kv
    bits = column_bits(width)
    check_packable(max(int(keys.max()), int(values.max())), bits + 1)
    packed = np.empty((rows, width), dtype=np.int64)
    np.left_shift(keys, bits + 1, out=packed[:, :kk])
    np.left_shift(values, bits + 1, out=packed[:, kk:])
    packed[:, kk:] |= 1 << bits
    packed |= np.arange(width, dtype=np.int64)
    packed.sort(axis=1)
    # Flat from here on: one running maximum over the whole block and 1-D gathers are
    # several times faster than their row-wise (axis=1) forms.
    packed = packed.ravel()
    column = packed & ((1 << bits) - 1)
    document = packed >> (bits + 1)  # arithmetic shift: PAD stays -1
    row_start = np.repeat(np.arange(0, rows * width, width, dtype=np.int64), width)
    last_key = np.where((column < kk) & (document != PAD),
                        np.arange(rows * width, dtype=np.int64), -1)
    np.maximum.accumulate(last_key, out=last_key)
    safe = np.maximum(last_key, 0)
    found = np.where((last_key >= row_start) & (document[safe] == document), column[safe], -1)
    out = np.empty(rows * width, dtype=np.int64)  # back to each cell's own column
    out[row_start + column] = found
    return out.reshape(rows, width)[:, kk:]


def column_bits(width: int) -> int:
    """Bits that hold a column index below ``width``."""
    return max(1, (width - 1).bit_length())


def check_packable(largest: int, bits: int) -> None:
    """Packing ``value << bits`` (plus lower fields) into an int64 must not overflow."""
    if largest >= 1 << (62 - bits):
        raise ValueError(f"document indices up to {largest} are too large to pack with "
                         f"{bits} more bits into int64")


def rowwise_isin(values: np.ndarray, members: np.ndarray) -> np.ndarray:
    """``values[i, j] in members[i, :]`` (PAD members ignored), for every cell."""
    if members.shape[1] <= 8:  # a few members per row (positives): one comparison each
        found = np.zeros(values.shape, dtype=bool)
        for column in range(members.shape[1]):
            member = members[:, column:column + 1]
            found |= (values == member) & (member != PAD)
        return found
    return rowwise_lookup(values, members) >= 0


def compact_rows(mask: np.ndarray, keep: int, *columns: tuple[np.ndarray, Any, npt.DTypeLike]
                 ) -> list[np.ndarray]:
    """Each row's cells where ``mask`` holds moved to the front in their order, the first
    ``keep`` kept: ``columns`` = (array, fill of the rest, output dtype)."""
    rows = mask.shape[0]
    target = np.cumsum(mask, axis=1) - 1
    selected = mask & (target < keep)
    row_index = np.broadcast_to(np.arange(rows)[:, None], mask.shape)[selected]
    column_index = target[selected]
    outputs = []
    for array, fill, dtype in columns:
        out = np.full((rows, keep), fill, dtype=dtype)
        out[row_index, column_index] = array[selected]
        outputs.append(out)
    return outputs


def lookup_rows(table_ids: np.ndarray, query_ids: Sequence[str] | np.ndarray,
                sorted_order: np.ndarray | None = None) -> np.ndarray:
    """The row of each query id in ``table_ids`` (the last one if repeated), -1 if absent.

    ``sorted_order``: ``np.argsort(table_ids, kind="stable")`` when the caller keeps it."""
    wanted = np.asarray(query_ids).astype(str)
    if len(table_ids) == 0:
        return np.full(len(wanted), -1, dtype=np.int64)
    order = np.argsort(table_ids, kind="stable") if sorted_order is None else sorted_order
    ordered = np.asarray(table_ids)[order]
    at = np.searchsorted(ordered, wanted, side="right") - 1
    safe = np.maximum(at, 0)
    found = (at >= 0) & (ordered[safe] == wanted)
    return np.where(found, order[safe], -1).astype(np.int64)
