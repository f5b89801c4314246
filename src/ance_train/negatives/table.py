"""The negatives table the Indexer writes and the Trainer samples from.

One row per training query: candidate document indices (positives already removed), their
scores under the checkpoint that mined them, the score of the query's positive, a sampling
probability per candidate and the source of each candidate; with MaxP also the passage of each
candidate and positive to train on. Sampling probabilities are
computed by the indexer, so drawing the negatives of a whole batch costs the trainer a few
vectorised array operations (:meth:`NegativesTable.sample_many`).

Stored as an ``.npz`` of uncompressed ``.npy`` members (``np.savez``, zip64 past 4 GiB). The
trainer reads it from a local file with :meth:`NegativesTable.open`, which memory-maps each
member where it lies in the archive: a table of MS MARCO size (500k queries × 400
candidates: ~5 GB) is never decompressed nor copied into memory as a whole, only the rows
a batch draws are paged in. Every table ever stored has this layout, so runs written before
``open`` existed read the same way.
"""

from __future__ import annotations

import io
import os
import struct
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ance_train.negatives.rows import (
    PAD,
    Positives,
    as_positives,
    compact_rows,
    lookup_rows,
    row_blocks,
    rowwise_isin,
)

if TYPE_CHECKING:
    from ance_train.infra.store import ObjectStore

SOURCES = ("ann", "bm25", "random", "momentum", "lookahead")
SOURCE_CODE = {name: code for code, name in enumerate(SOURCES)}
__all__ = ["PAD", "SOURCES", "SOURCE_CODE", "NegativesTable", "Positives", "store_table"]
_ZIP_LOCAL_HEADER = b"PK\x03\x04"
_ZIP_LOCAL_HEADER_SIZE = 30  # then the name and the extra field, whose lengths end it


@dataclass
class NegativesTable:
    step: int                      # checkpoint that produced it (-1: BM25 warm-up)
    query_ids: np.ndarray          # [Q] str
    candidates: np.ndarray         # [Q, K] int64 doc indices, PAD where a row is short
    scores: np.ndarray             # [Q, K] float32
    positive_scores: np.ndarray    # [Q] float32, score of the query's (first) positive
    probabilities: np.ndarray      # [Q, K] float32, rows sum to 1 over valid candidates
    sources: np.ndarray            # [Q, K] int8, index into SOURCES
    first_seen: np.ndarray | None = None  # [Q, K] int64 step at which a candidate entered the row
    # When the candidates are queries, not documents (DANCE's negative queries): the query id
    # each candidate index stands for, so readers never rely on a positional convention.
    candidate_query_ids: np.ndarray | None = None  # [N] str
    # MaxP (data.passages.mode max): the passage the trainer trains on for each candidate and
    # each of the row's positives: the one that scored highest for the row's query in the
    # index that mined the table (index/passages.py).
    passages: np.ndarray | None = None           # [Q, K] int8
    positive_docs: np.ndarray | None = None      # [Q, P] int64 the row's positives, PAD-padded
    positive_passages: np.ndarray | None = None  # [Q, P] int8

    def __post_init__(self) -> None:
        # Built on first use: a table the indexer only writes, or reads as a whole through
        # ``rows_of``, never pays for a per-query dictionary.
        self._row: dict[str, int] | None = None
        self._sorted: np.ndarray | None = None
        if self.first_seen is None:
            self.first_seen = np.where(self.candidates != PAD, self.step, PAD).astype(np.int64)

    def __len__(self) -> int:
        return len(self.query_ids)

    @property
    def _rows(self) -> dict[str, int]:
        if self._row is None:
            ids = np.asarray(self.query_ids).astype(str).tolist()
            self._row = dict(zip(ids, range(len(ids)), strict=True))
        return self._row

    def row(self, query_id: str) -> int | None:
        return self._rows.get(query_id)

    def rows_of(self, query_ids: Sequence[str] | np.ndarray) -> np.ndarray:
        """:meth:`row` of every query id at once (-1 where absent), without a Python loop."""
        ids = np.asarray(self.query_ids).astype(str)
        if self._sorted is None:  # the indexer's ids are sorted and distinct: no sort
            ascending = len(ids) < 2 or bool((ids[1:] > ids[:-1]).all())
            self._sorted = (np.arange(len(ids)) if ascending
                            else np.argsort(ids, kind="stable"))
        return lookup_rows(ids, query_ids, self._sorted)

    def sample(self, query_id: str, n: int, rng: np.random.Generator) -> list[int]:
        """Draw ``n`` distinct negatives (fewer if the row is short) by the stored probabilities."""
        return self.sample_many([query_id], n, rng)[0]

    def sample_many(self, query_ids: Sequence[str], n: int,
                    rng: np.random.Generator) -> list[list[int]]:
        """:meth:`sample` for every query of a batch in one vectorised draw.

        Exponential races (the Gumbel-top-k trick without logarithms): with ``E ~ Exp(1)``
        per candidate, the ``n`` largest ``p / E`` of a row are distributed as ``n``
        successive draws without replacement by ``p`` (what ``rng.choice(replace=False,
        p=p)`` does), at the cost of a few array operations per batch instead of per query.
        Candidates whose probability underflowed to 0 (SimANS at a small temperature) are never
        drawn, so a row gives at most its non-zero candidates.
        """
        picked: list[list[int]] = [[] for _ in query_ids]
        found = [(i, row) for i, q in enumerate(query_ids)
                 if (row := self._rows.get(str(q))) is not None]
        if n <= 0 or not found:
            return picked
        rows = np.fromiter((row for _, row in found), dtype=np.int64, count=len(found))
        candidates, probabilities = self.candidates[rows], self.probabilities[rows]
        drawable = (candidates != PAD) & (probabilities > 0)
        races = rng.standard_exponential(size=candidates.shape, dtype=np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):  # E = 0: an infinite key
            keys = np.where(drawable, probabilities / races, 0.0)
        take = min(n, keys.shape[1])
        if take == 1:
            top = keys.argmax(axis=1)[:, None]
        else:  # the take largest, in draw order
            top = np.argpartition(-keys, take - 1, axis=1)[:, :take]
            order = np.argsort(-np.take_along_axis(keys, top, axis=1), axis=1, kind="stable")
            top = np.take_along_axis(top, order, axis=1)
        docs = np.take_along_axis(candidates, top, axis=1)
        valid = np.take_along_axis(keys, top, axis=1) > 0
        for (i, _), row_docs, row_valid in zip(found, docs, valid, strict=True):
            picked[i] = row_docs[row_valid].tolist()
        return picked

    def passage_of(self, query_id: str, doc: int) -> int:
        """MaxP: the passage of document ``doc`` to train on with ``query_id``, as a positive
        or a negative of its row; 0 (the first passage) when the table chose none."""
        row = self.row(query_id) if self.passages is not None else None
        if row is None:
            return 0
        if self.positive_docs is not None and self.positive_passages is not None:
            hit = np.flatnonzero(self.positive_docs[row] == doc)
            if len(hit):
                return int(self.positive_passages[row, hit[0]])
        assert self.passages is not None
        hit = np.flatnonzero(self.candidates[row] == doc)
        return int(self.passages[row, hit[0]]) if len(hit) else 0

    def _members(self) -> dict[str, np.ndarray | np.int64 | None]:
        extra = ({} if self.candidate_query_ids is None
                 else {"candidate_query_ids": np.asarray(self.candidate_query_ids).astype(str)})
        for name in ("passages", "positive_docs", "positive_passages"):
            if getattr(self, name) is not None:
                extra[name] = getattr(self, name)
        return dict(step=np.int64(self.step), query_ids=np.asarray(self.query_ids).astype(str),
                    candidates=self.candidates, scores=self.scores,
                    positive_scores=self.positive_scores, probabilities=self.probabilities,
                    sources=self.sources, first_seen=self.first_seen, **extra)

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        # uncompressed members: see ``open``. ignore: numpy's stub matches **members against
        # savez's `allow_pickle: bool` too (and it takes the None of an unset member as well).
        np.savez(buffer, **self._members())  # type: ignore[arg-type]
        return buffer.getvalue()

    def write(self, path: str | os.PathLike[str]) -> None:
        """:meth:`to_bytes` into a local file, without the copy in memory."""
        with open(path, "wb") as f:
            np.savez(f, **self._members())  # type: ignore[arg-type]  # as in to_bytes

    @classmethod
    def _from_arrays(cls, arrays: dict[str, np.ndarray] | np.lib.npyio.NpzFile
                     ) -> NegativesTable:
        return cls(step=int(arrays["step"]), query_ids=arrays["query_ids"],
                   candidates=arrays["candidates"], scores=arrays["scores"],
                   positive_scores=arrays["positive_scores"],
                   probabilities=arrays["probabilities"], sources=arrays["sources"],
                   first_seen=arrays.get("first_seen"),
                   candidate_query_ids=arrays.get("candidate_query_ids"),
                   passages=arrays.get("passages"), positive_docs=arrays.get("positive_docs"),
                   positive_passages=arrays.get("positive_passages"))

    @classmethod
    def from_bytes(cls, data: bytes) -> NegativesTable:
        """A table in memory (every array read out of ``data``)."""
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            return cls._from_arrays(arrays)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> NegativesTable:
        """A table stored in the local file ``path``, its arrays memory-mapped read-only
        (see the module docstring); a compressed member, if any, is read into memory."""
        path = Path(path)
        try:
            return cls._from_arrays(_map_npz(path))
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, struct.error) as error:
            raise ValueError(f"{path}: not a readable negatives table: {error}") from error


def store_table(store: ObjectStore, key: str, table: NegativesTable,
                scratch: str | os.PathLike[str]) -> str:
    """Upload ``table`` under ``key`` through a temporary file in ``scratch`` (streamed, so a
    large table is never copied whole in memory as :meth:`NegativesTable.to_bytes` would);
    return its sha256."""
    Path(scratch).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch, prefix="table-") as directory:
        path = Path(directory) / "table.npz"
        table.write(path)
        return store.put_file(key, path)


def _map_npz(path: Path) -> dict[str, np.ndarray]:
    """Every member of the ``.npz`` at ``path``: an uncompressed one memory-mapped where its
    ``.npy`` data lies in the archive, the others (compressed, scalars, empty) read."""
    arrays: dict[str, np.ndarray] = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as raw:
        for info in archive.infolist():
            name = info.filename.removesuffix(".npy")
            mapped = None
            if info.compress_type == zipfile.ZIP_STORED:
                raw.seek(info.header_offset)
                local = raw.read(_ZIP_LOCAL_HEADER_SIZE)
                if local[:4] != _ZIP_LOCAL_HEADER:
                    raise ValueError(f"member {info.filename} has no local zip header")
                name_length, extra_length = struct.unpack("<HH", local[26:30])
                raw.seek(info.header_offset + _ZIP_LOCAL_HEADER_SIZE + name_length + extra_length)
                version = np.lib.format.read_magic(raw)
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)
                shape, fortran, dtype = read_header(raw)
                if dtype.hasobject:
                    raise ValueError(f"member {info.filename} holds Python objects")
                if shape and int(np.prod(shape)) > 0:
                    mapped = np.memmap(raw, dtype=dtype, mode="r", offset=raw.tell(),
                                       shape=shape, order="F" if fortran else "C")
            if mapped is not None:
                arrays[name] = mapped.view(np.ndarray)
            else:
                with archive.open(info) as member:
                    arrays[name] = np.lib.format.read_array(member, allow_pickle=False)
    return arrays


def source_counts(table: NegativesTable) -> dict[str, int]:
    """How many candidates of the table come from each source (ANCE-Tele Fig. 9)."""
    valid = table.candidates != PAD
    return {name: int(((table.sources == code) & valid).sum()) for code, name in
            enumerate(SOURCES) if ((table.sources == code) & valid).any()}


def source_codes(candidates: np.ndarray, source: str) -> np.ndarray:
    """The ``sources`` array of candidates that all come from ``source`` (-1 on padding)."""
    return np.where(candidates != PAD, SOURCE_CODE[source], -1).astype(np.int8)


def uniform_probabilities(candidates: np.ndarray) -> np.ndarray:
    """ANCE §4/§5: negatives are sampled uniformly from the ANN top-K minus the positives."""
    valid = (candidates != PAD).astype(np.float32)
    counts = valid.sum(axis=1, keepdims=True)
    return np.divide(valid, counts, out=np.zeros_like(valid), where=counts > 0)


def remove_positives(
    ranked: np.ndarray, scores: np.ndarray, positives: Positives | Sequence[set[int]],
    keep: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Drop each row's positives (and FAISS's -1 padding), keep the first ``keep`` of the rest
    (in their order; PAD and 0 after them)."""
    positives = as_positives(positives)
    if not len(ranked) == len(scores) == len(positives):
        raise ValueError(f"remove_positives: {len(ranked)} ranked rows, {len(scores)} score "
                         f"rows, {len(positives)} rows of positives")
    out_ids = np.full((len(ranked), keep), PAD, dtype=np.int64)
    out_scores = np.zeros((len(ranked), keep), dtype=np.float32)
    for block in row_blocks(len(ranked), ranked.shape[1]):
        ids = ranked[block]
        mask = (ids != PAD) & ~rowwise_isin(ids, positives.dense(block))
        out_ids[block], out_scores[block] = compact_rows(
            mask, keep, (ids, PAD, np.int64), (scores[block], 0.0, np.float32))
    return out_ids, out_scores


def overlap_at(candidates: np.ndarray, top: np.ndarray) -> float:
    """Share of negative candidates that are also in ``top`` (same rows), ignoring padding."""
    if len(candidates) != len(top):
        raise ValueError(f"overlap_at: {len(candidates)} candidate rows, {len(top)} top rows")
    hits = total = 0
    for block in row_blocks(len(candidates), candidates.shape[1] + top.shape[1]):
        valid = candidates[block] != PAD
        hits += int((valid & rowwise_isin(candidates[block], top[block])).sum())
        total += int(valid.sum())
    return hits / total if total else 0.0
