"""The indexer's mining machinery shared by the strategies (each strategy's own part lives in
its module under :mod:`ance_train.negatives.strategies`).

At each refresh :meth:`Miner.mine` turns the ANN search results of the training queries into
candidates: the positives removed, the positive-aware filter applied
(``negatives.max_positive_ratio``), one positive ``d̃⁺`` drawn per query as the anchor, and
the configured sampling strategy's probabilities; the configured pool strategy then makes
its table of them (ANCE keeps them, ANCE-Tele mixes in momentum and lookahead negatives).
With MaxP the index is a :class:`~ance_train.index.passages.PassageIndex`: everything here is
about documents (scored by their best passage), and the table also names the passage of each
candidate and positive to train on (:meth:`Miner.choose_passages`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ance_train.data.dataset import DatasetIndex
from ance_train.index.passages import PassageIndex
from ance_train.negatives.rows import Positives, row_blocks, rowwise_lookup
from ance_train.negatives.strategies.base import AnnRefresh, MiningIndex
from ance_train.negatives.table import PAD, NegativesTable, remove_positives, source_codes

if TYPE_CHECKING:
    from ance_train.config import NegativesConfig


def positives_of(dataset: DatasetIndex, query_ids: list[str]) -> list[set[int]]:
    return [set(dataset.positives(q)) for q in query_ids]


def positives_csr(dataset: DatasetIndex, query_ids: list[str]) -> Positives:
    """The positives of ``query_ids`` as one CSR matrix (built once, used at every refresh)."""
    return Positives.from_rows([dataset.positives(q) for q in query_ids])


def draw_anchors(positives: Positives, rng: np.random.Generator) -> np.ndarray:
    """d̃⁺: one positive drawn at random per query (SimANS §4.1; Tele's lookahead anchor).

    One ``rng.integers`` call over all rows draws what one call per row, in row order, did
    (numpy draws a broadcast ``high`` element by element), leaving ``rng`` in the same state."""
    return positives.indices[positives.indptr[:-1] + rng.integers(0, positives.counts)]


def drop_near_positive(candidates: np.ndarray, sims: np.ndarray, positive_sims: np.ndarray,
                       ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """Positive-aware false-negative filter: keep a candidate only if its similarity is at most
    ``ratio × s(q, d⁺)``; each row's survivors move to the front, in their original order.

    Unlabelled relevant documents score like the positive, so the candidates closest to (or
    above) it are the likeliest false negatives (NV-Retriever's TopK-PercPos uses 0.95).
    """
    keep = (candidates != PAD) & (sims <= ratio * positive_sims[:, None])
    order = np.argsort(~keep, axis=1, kind="stable")  # kept first, original order within
    kept = np.take_along_axis(keep, order, axis=1)
    out_ids = np.where(kept, np.take_along_axis(candidates, order, axis=1), PAD)
    out_sims = np.where(kept, np.take_along_axis(sims, order, axis=1), 0.0)
    return out_ids.astype(np.int64), out_sims.astype(sims.dtype)


def align_rows(previous: NegativesTable, query_ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The previous table's candidates/probabilities re-ordered to ``query_ids`` (PAD if absent)."""
    old = previous.rows_of(query_ids)
    absent = old < 0
    width = previous.candidates.shape[1]
    candidates = np.empty((len(query_ids), width), dtype=np.int64)
    probabilities = np.empty((len(query_ids), width), dtype=np.float32)
    if len(previous):
        _gather(previous.candidates, old, candidates)
        _gather(previous.probabilities, old, probabilities)
    else:
        absent[:] = True
    candidates[absent] = PAD
    probabilities[absent] = 0
    return candidates, probabilities


def _gather(source: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = source[rows]`` (rows clipped into range), without a temporary copy when
    the dtypes agree."""
    if source.dtype == out.dtype:
        np.take(source, rows, axis=0, out=out, mode="clip")
    else:
        out[:] = source[np.clip(rows, 0, len(source) - 1)]


def first_seen(candidates: np.ndarray, step: int, previous: NegativesTable | None,
               query_ids: list[str]) -> np.ndarray:
    """Step at which each candidate entered its row, carried over from the previous table
    while the candidate stays in the row (ANCE-Tele Fig. 9 "first introduced" episodes).
    A document the previous row holds twice carries the step of its later column."""
    seen = np.where(candidates != PAD, step, PAD).astype(np.int64)
    if previous is None or previous.first_seen is None:
        return seen
    old = previous.rows_of(query_ids)
    kept = previous.candidates.shape[1]
    for block in row_blocks(len(candidates), candidates.shape[1] + kept):
        rows = old[block]
        absent = rows < 0
        if absent.all():
            continue
        rows = np.maximum(rows, 0)  # an absent row looks at row 0, then is discarded
        earlier = rowwise_lookup(candidates[block], np.take(previous.candidates, rows, axis=0))
        earlier[absent] = -1
        offsets = np.arange(len(rows), dtype=np.int64)[:, None] * kept
        carried = np.take(previous.first_seen, rows, axis=0).ravel()[
            offsets + np.maximum(earlier, 0)]
        np.copyto(seen[block], carried, where=earlier >= 0)
    return seen


class Miner:
    """ANN negatives of one refresh for the training queries, for the pools that mine them
    (``PoolStrategy.mines_ann``), drawn by the configured sampling strategy."""

    def __init__(self, config: NegativesConfig, temperature: float, dataset: DatasetIndex,
                 train_ids: list[str], seed: int) -> None:
        self.config = config
        self.pool = config.pool_strategy
        self.sampling = config.sampling_strategy
        self.temperature = temperature
        self.train_ids = train_ids
        self.positives = positives_csr(dataset, train_ids)
        self.max_positives = int(self.positives.counts.max())
        self.query_ids = np.array(train_ids)
        self.seed = seed

    def depth(self) -> int:
        """How deep the candidates go: the sampling strategy's k (SimANS: its own top-k)."""
        return self.sampling.depth()

    def probabilities(self, candidates: np.ndarray, scores: np.ndarray,
                      positive_scores: np.ndarray) -> np.ndarray:
        return self.sampling.probabilities(candidates, scores, positive_scores)

    def scores(self, index: MiningIndex, queries: np.ndarray, candidates: np.ndarray
               ) -> np.ndarray:
        """``s(q, d) = sim / temperature`` for each candidate (0 on padding)."""
        safe = np.where(candidates != PAD, candidates, 0)
        sims = index.scores(queries, safe)  # a block of rows at a time, never Q × K × dim
        return np.where(candidates != PAD, sims / self.temperature, 0.0).astype(np.float32)

    def mine(self, step: int, index: MiningIndex, queries: np.ndarray, ranked: np.ndarray,
             sims: np.ndarray, previous: NegativesTable | None,
             cancel: Callable[[], None] | None = None,
             search_batch: int = 1024) -> NegativesTable:
        """``queries``: training-query embeddings in ``train_ids`` order; ``ranked``/``sims``:
        their search results, at least ``depth() + max_positives`` deep."""
        cfg = self.config
        rng = np.random.default_rng([self.seed, max(step, 0)])
        k = self.depth()
        candidates, candidate_sims = remove_positives(ranked, sims, self.positives, k)
        anchor = draw_anchors(self.positives, rng)
        anchor_vectors = index.best_vectors(queries, anchor)
        positive_sims = np.einsum("qd,qd->q", queries, anchor_vectors)
        if cfg.max_positive_ratio is not None:
            candidates, candidate_sims = drop_near_positive(
                candidates, candidate_sims, positive_sims, cfg.max_positive_ratio)
        scores = np.where(candidates != PAD, candidate_sims / self.temperature, 0.0)
        positive_scores = (positive_sims / self.temperature).astype(np.float32)
        refresh = AnnRefresh(
            step=step, index=index, queries=queries, anchor_vectors=anchor_vectors,
            candidates=candidates, scores=scores, positive_scores=positive_scores,
            probabilities=self.probabilities(candidates, scores, positive_scores),
            sources=source_codes(candidates, "ann"),
            depth=k, previous=previous, rng=rng, cancel=cancel,
            search_batch=search_batch)
        table = self.pool.mine(self, refresh)
        if table is None:
            raise ValueError(f"negatives.pool {cfg.pool} does not mine ANN negatives")
        if isinstance(index, PassageIndex):
            self.choose_passages(table, index, queries)
        return table

    def choose_passages(self, table: NegativesTable, index: PassageIndex,
                        queries: np.ndarray) -> None:
        """MaxP: the passage of each candidate and positive that the trainer trains on, the
        one that scores highest for the row's query in this index (what ranks the document
        where it is). Computed on the pool's final table, so momentum and lookahead
        negatives (ANCE-Tele) get this refresh's best passage too."""
        table.passages = index.best_passages(queries, table.candidates).astype(np.int8)
        table.positive_docs = self.positives.dense(slice(None))
        table.positive_passages = index.best_passages(
            queries, table.positive_docs).astype(np.int8)

    def table(self, refresh: AnnRefresh) -> NegativesTable:
        """The negatives table of a refresh's (possibly re-mixed) candidates."""
        return NegativesTable(
            step=refresh.step, query_ids=self.query_ids, candidates=refresh.candidates,
            scores=refresh.scores.astype(np.float32), positive_scores=refresh.positive_scores,
            probabilities=refresh.probabilities.astype(np.float32), sources=refresh.sources,
            first_seen=first_seen(refresh.candidates, refresh.step, refresh.previous,
                                  self.train_ids))

