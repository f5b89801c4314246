"""The negatives table the Indexer writes and the Trainer samples from.

One row per training query: candidate document indices (positives already removed), their
scores under the checkpoint that mined them, the score of the query's positive, a sampling
probability per candidate and the source of each candidate. Sampling probabilities are
computed by the indexer, so drawing the negatives of a whole batch costs the trainer a few
vectorised array operations (:meth:`NegativesTable.sample_many`).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SOURCES = ("ann", "bm25", "random", "momentum", "lookahead")
SOURCE_CODE = {name: code for code, name in enumerate(SOURCES)}
PAD = -1


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

    def __post_init__(self) -> None:
        self._row = {str(qid): row for row, qid in enumerate(self.query_ids)}
        if self.first_seen is None:
            self.first_seen = np.where(self.candidates != PAD, self.step, PAD).astype(np.int64)

    def __len__(self) -> int:
        return len(self.query_ids)

    def row(self, query_id: str) -> int | None:
        return self._row.get(query_id)

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
                 if (row := self._row.get(str(q))) is not None]
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

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        extra = ({} if self.candidate_query_ids is None
                 else {"candidate_query_ids": self.candidate_query_ids.astype(str)})
        np.savez(buffer, step=np.int64(self.step), query_ids=self.query_ids.astype(str),
                 candidates=self.candidates, scores=self.scores,
                 positive_scores=self.positive_scores, probabilities=self.probabilities,
                 sources=self.sources, first_seen=self.first_seen, **extra)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> NegativesTable:
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            return cls(step=int(arrays["step"]), query_ids=arrays["query_ids"],
                       candidates=arrays["candidates"], scores=arrays["scores"],
                       positive_scores=arrays["positive_scores"],
                       probabilities=arrays["probabilities"], sources=arrays["sources"],
                       first_seen=arrays.get("first_seen"),
                       candidate_query_ids=arrays.get("candidate_query_ids"))


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
    ranked: np.ndarray, scores: np.ndarray, positives: list[set[int]], keep: int
) -> tuple[np.ndarray, np.ndarray]:
    """Drop each row's positives (and FAISS's -1 padding), keep the first ``keep`` of the rest."""
    out_ids = np.full((len(ranked), keep), PAD, dtype=np.int64)
    out_scores = np.zeros((len(ranked), keep), dtype=np.float32)
    for row, (ids, row_scores, pos) in enumerate(zip(ranked, scores, positives, strict=True)):
        mask = ids != PAD
        if pos:
            mask &= ~np.isin(ids, np.fromiter(pos, dtype=np.int64))
        kept_ids, kept_scores = ids[mask][:keep], row_scores[mask][:keep]
        out_ids[row, : len(kept_ids)] = kept_ids
        out_scores[row, : len(kept_scores)] = kept_scores
    return out_ids, out_scores


def overlap_at(candidates: np.ndarray, top: np.ndarray) -> float:
    """Share of negative candidates that are also in ``top`` (same rows), ignoring padding."""
    hits = total = 0
    for cand_row, top_row in zip(candidates, top, strict=True):
        cand = cand_row[cand_row != PAD]
        hits += int(np.isin(cand, top_row[top_row != PAD]).sum())
        total += len(cand)
    return hits / total if total else 0.0
