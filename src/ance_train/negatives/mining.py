"""Turning retrieval results into training negatives, for every configured strategy.

``Miner.mine`` runs at each refresh for the ANN pools (``ann``: ANCE; ``tele``: ANCE-Tele),
with uniform or SimANS sampling; ``bm25_negatives`` runs once at start-up for the BM25 pools
and the BM25 warm-up; ``mine_dual`` gives DANCE's negative queries. The formulas themselves
live in :mod:`.strategies`.
"""

from __future__ import annotations

import bm25s
import faiss
import numpy as np

from ance_train.config import NegativesConfig
from ance_train.data.corpus import Corpus
from ance_train.data.dataset import DatasetIndex
from ance_train.index.ann import AnnIndex
from ance_train.negatives.strategies import (
    align_rows,
    drop_near_positive,
    dual_query_negatives,
    first_seen,
    keep_previous_rows,
    merge_remined,
    mix_rows,
    simans_probabilities,
)
from ance_train.negatives.table import (
    PAD,
    SOURCE_CODE,
    NegativesTable,
    remove_positives,
    uniform_probabilities,
)


def positives_of(dataset: DatasetIndex, query_ids: list[str]) -> list[set[int]]:
    return [set(dataset.positives(q)) for q in query_ids]


def ance_negatives(
    step: int, query_ids: list[str], ranked: np.ndarray, scores: np.ndarray,
    positives: list[set[int]], positive_scores: np.ndarray, top_k: int,
) -> NegativesTable:
    """ANCE: the top-K minus the positives, sampled uniformly (ANCE §4, §5: K = 200)."""
    candidates, candidate_scores = remove_positives(ranked, scores, positives, top_k)
    return NegativesTable(
        step=step, query_ids=np.array(query_ids), candidates=candidates,
        scores=candidate_scores, positive_scores=positive_scores.astype(np.float32),
        probabilities=uniform_probabilities(candidates),
        sources=np.where(candidates != PAD, SOURCE_CODE["ann"], -1).astype(np.int8),
    )


def bm25_negatives(corpus: Corpus, dataset: DatasetIndex, query_ids: list[str],
                   top_k: int, chunk: int = 10000) -> NegativesTable:
    """BM25 (bm25s) top-``top_k`` minus the positives (ANCE Table 1 "BM25 Neg": top 100)."""
    texts: list[str] = []
    for start in range(0, len(corpus), chunk):
        texts.extend(text for _, text in corpus.iter_range(start, min(start + chunk, len(corpus))))
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(texts, stopwords="en", show_progress=False),
                    show_progress=False)
    del texts
    positives = positives_of(dataset, query_ids)
    depth = min(len(corpus), top_k + max(len(p) for p in positives))
    query_tokens = bm25s.tokenize([dataset.queries[q] for q in query_ids], stopwords="en",
                                  show_progress=False)
    ranked, scores = retriever.retrieve(query_tokens, k=depth, show_progress=False, n_threads=1)
    table = ance_negatives(-1, query_ids, ranked.astype(np.int64), scores.astype(np.float32),
                           positives, np.zeros(len(query_ids), np.float32), top_k)
    table.sources[table.candidates != PAD] = SOURCE_CODE["bm25"]
    return table


class Miner:
    """ANN negatives of one refresh for the training queries (pools ``ann`` and ``tele``)."""

    def __init__(self, config: NegativesConfig, temperature: float, dataset: DatasetIndex,
                 train_ids: list[str], seed: int) -> None:
        self.config = config
        self.temperature = temperature
        self.train_ids = train_ids
        self.positives = positives_of(dataset, train_ids)
        self.positive_lists = [sorted(p) for p in self.positives]
        self.max_positives = max(len(p) for p in self.positives)
        self.seed = seed

    def depth(self) -> int:
        """How deep the candidates go: SimANS samples from the top-k (k = 100), ANCE from K."""
        cfg = self.config
        return cfg.simans_top_k if cfg.sampling == "simans" else cfg.top_k

    def _probabilities(self, candidates: np.ndarray, scores: np.ndarray,
                       positive_scores: np.ndarray) -> np.ndarray:
        if self.config.sampling == "simans":
            return simans_probabilities(scores, candidates, positive_scores,
                                        self.config.simans_a, self.config.simans_b)
        return uniform_probabilities(candidates)

    def _scores(self, index: AnnIndex, queries: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        """``s(q, d) = sim / temperature`` for each candidate (0 on padding)."""
        safe = np.where(candidates != PAD, candidates, 0)
        sims = index.scores(queries, safe)  # a block of rows at a time, never Q × K × dim
        return np.where(candidates != PAD, sims / self.temperature, 0.0).astype(np.float32)

    def mine(self, step: int, index: AnnIndex, queries: np.ndarray, ranked: np.ndarray,
             sims: np.ndarray, previous: NegativesTable | None, should_stop=None,
             search_batch: int = 1024) -> NegativesTable:
        """``queries``: training-query embeddings in ``train_ids`` order; ``ranked``/``sims``:
        their search results, at least ``depth() + max_positives`` deep."""
        cfg = self.config
        rng = np.random.default_rng([self.seed, max(step, 0)])
        k = self.depth()
        candidates, candidate_sims = remove_positives(ranked, sims, self.positives, k)
        # d̃⁺: one positive drawn at random per query (SimANS §4.1; Tele's lookahead anchor).
        anchor = np.array([p[rng.integers(len(p))] for p in self.positive_lists], dtype=np.int64)
        anchor_vectors = index.vectors(anchor)
        positive_sims = np.einsum("qd,qd->q", queries, anchor_vectors)
        if cfg.max_positive_ratio is not None:
            candidates, candidate_sims = drop_near_positive(
                candidates, candidate_sims, positive_sims, cfg.max_positive_ratio)
        scores = np.where(candidates != PAD, candidate_sims / self.temperature, 0.0)
        positive_scores = (positive_sims / self.temperature).astype(np.float32)
        probabilities = self._probabilities(candidates, scores, positive_scores)
        sources = np.where(candidates != PAD, SOURCE_CODE["ann"], -1).astype(np.int8)

        if cfg.pool == "tele":
            candidates, probabilities, sources = self._teleport(
                index, queries, anchor_vectors, candidates, probabilities, positive_scores,
                previous, k, should_stop, search_batch)
            scores = self._scores(index, queries, candidates)

        table = NegativesTable(
            step=step, query_ids=np.array(self.train_ids), candidates=candidates,
            scores=scores.astype(np.float32), positive_scores=positive_scores,
            probabilities=probabilities.astype(np.float32), sources=sources,
            first_seen=first_seen(candidates, step, previous, self.train_ids))
        if cfg.remine_fraction < 1.0 and previous is not None and previous.step >= 0:
            remined = keep_previous_rows(table, previous, cfg.remine_fraction, rng)
            merge_remined(table, previous, remined)
        return table

    def _teleport(self, index, queries, anchor_vectors, candidates, probabilities,
                  positive_scores, previous, k, should_stop, search_batch):
        """ANCE-Tele Eq. 4-6: current ANN ∪ α·momentum ∪ β·lookahead (ANN of d⁺)."""
        cfg = self.config
        # Lookahead: neighbours of the positive document, minus the positives themselves.
        near, near_sims = index.search(anchor_vectors, k + self.max_positives, search_batch,
                                       should_stop)
        look, _ = remove_positives(near, near_sims, self.positives, k)
        look_probs = self._probabilities(look, self._scores(index, queries, look),
                                         positive_scores)
        parts = [(candidates, probabilities, SOURCE_CODE["ann"], 1.0)]
        if previous is not None and previous.step >= 0:  # Eq. 7: no momentum in episode 0
            mom, mom_probs = align_rows(previous, self.train_ids)
            parts.append((mom, mom_probs, SOURCE_CODE["momentum"], cfg.tele_momentum_weight))
        parts.append((look, look_probs, SOURCE_CODE["lookahead"], cfg.tele_lookahead_weight))
        return mix_rows(parts, cfg.tele_max_candidates)


def mine_dual(step: int, config: NegativesConfig, dataset: DatasetIndex, train_ids: list[str],
              index: AnnIndex, train_queries: np.ndarray) -> NegativesTable:
    """DANCE's negative queries: for each positive document, the nearest training queries
    (embedding space of the current checkpoint) that do not have it as a positive."""
    owners: dict[int, set[int]] = {}
    for row, qid in enumerate(train_ids):
        for doc in dataset.positives(qid):
            owners.setdefault(doc, set()).add(row)
    docs = sorted(owners)
    query_index = faiss.IndexFlatIP(train_queries.shape[1])
    query_index.add(np.ascontiguousarray(train_queries, dtype=np.float32))
    depth = min(len(train_ids), config.dual_top_k + max(len(o) for o in owners.values()))
    sims, ranked = query_index.search(np.ascontiguousarray(index.vectors(np.array(docs))), depth)
    return dual_query_negatives(docs, ranked.astype(np.int64), sims, owners, config.dual_top_k,
                                step)
