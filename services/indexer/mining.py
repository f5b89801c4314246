"""Turning retrieval results into training negatives (ANCE) and the BM25 warm-up negatives."""

from __future__ import annotations

import bm25s
import numpy as np

from ance_train.common.data import Corpus, DatasetIndex
from ance_train.common.negatives import (
    PAD,
    SOURCE_CODE,
    NegativesTable,
    remove_positives,
    uniform_probabilities,
)


def positives_of(dataset: DatasetIndex, query_ids: list[str]) -> list[set[int]]:
    return [{doc for doc, rel in dataset.train[q].items() if rel > 0} for q in query_ids]


def ance_negatives(
    step: int, query_ids: list[str], ranked: np.ndarray, scores: np.ndarray,
    positives: list[set[int]], positive_scores: np.ndarray, top_k: int,
) -> NegativesTable:
    """ANCE: the ANN top-K minus the positives, sampled uniformly (ANCE §4, §5: K = 200)."""
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
