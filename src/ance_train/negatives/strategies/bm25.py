"""BM25 negatives: lexical hard negatives, fixed for the whole run.

Paper: Vladimir Karpukhin, Barlas Oğuz, Sewon Min, Patrick Lewis, Ledell Wu, Sergey Edunov,
Danqi Chen, Wen-tau Yih. "Dense Passage Retrieval for Open-Domain Question Answering". EMNLP
2020. arXiv:2004.04906.

DPR §3.2 ("Positive and negative passages": top BM25 passages that are not positives) as
ANCE (arXiv:2007.00808) runs it as the "BM25 Neg" baseline of its Table 1: negatives drawn
uniformly from the BM25 top 100 (``negatives.bm25.top_k``) minus the positives, trained with the NLL
loss of DPR Eq. 2,

    L(q, p⁺, p⁻_1..n) = −log( e^{sim(q, p⁺)} / (e^{sim(q, p⁺)} + Σ_j e^{sim(q, p⁻_j)}) ).

The indexer builds the table once at start-up with bm25s (:func:`bm25_negatives`); the
same table serves the BM25 warm-up of the other pools ("BM25 → X", ANCE Table 1) and the
``bm25_random`` pool.

Pool ``bm25`` (:class:`Bm25Pool`).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar

import bm25s
import numpy as np
from pydantic import Field

from ance_train.negatives.mining import positives_of
from ance_train.negatives.strategies.ance import ance_negatives
from ance_train.negatives.strategies.base import (
    NegativeSource,
    PoolStrategy,
    StrategySettings,
    TableHolder,
)
from ance_train.negatives.table import PAD, SOURCE_CODE, NegativesTable
from ance_train.protocol.tables import TableId

if TYPE_CHECKING:
    from ance_train.config import RunConfig
    from ance_train.data.corpus import Corpus
    from ance_train.data.dataset import DatasetIndex
    from ance_train.negatives.strategies.random import RandomNegatives


class Bm25Settings(StrategySettings):
    """``negatives.bm25``: how deep the BM25 table goes (also for the BM25 warm-up)."""

    top_k: int = Field(100, ge=1, description="ANCE Table 1 BM25 negatives: top 100.")


# bm25s's top-k selection, pinned: its default ("auto") picks JAX whenever JAX is installed,
# and JAX's first operation on a machine with a GPU preallocates 75 % of the GPU's memory
# (XLA_PYTHON_CLIENT_PREALLOCATE). On the H200 machine (2026-11-26) that starved the trainer
# sharing the GPU (CUDA out of memory at start-up). NumPy is what every CPU run used anyway.
BM25_TOP_K_BACKEND = "numpy"


def bm25_index(texts: list[str], *, k1: float = 1.5, b: float = 0.75) -> bm25s.BM25:
    """bm25s over ``texts`` (English stop words). k1/b default to bm25s's (the indexer's
    table); the quality benchmark's reference uses BEIR's k1=0.9, b=0.4. The index keeps no
    reference to ``texts``: callers drop them before ranking (a whole corpus of strings)."""
    retriever = bm25s.BM25(k1=k1, b=b)
    retriever.index(bm25s.tokenize(texts, stopwords="en", show_progress=False),
                    show_progress=False)
    return retriever


def bm25_rank(retriever: bm25s.BM25, queries: list[str],
              depth: int) -> tuple[np.ndarray, np.ndarray]:
    """Each query's top ``depth`` document indices and scores, best first."""
    query_tokens = bm25s.tokenize(queries, stopwords="en", show_progress=False)
    return retriever.retrieve(query_tokens, k=depth, show_progress=False, n_threads=1,
                              backend_selection=BM25_TOP_K_BACKEND)


def bm25_negatives(corpus: Corpus, dataset: DatasetIndex, query_ids: list[str],
                   top_k: int, chunk: int = 10000) -> NegativesTable:
    """BM25 (bm25s) top-``top_k`` minus the positives (ANCE Table 1 "BM25 Neg": top 100)."""
    texts: list[str] = []
    for start in range(0, len(corpus), chunk):
        texts.extend(text for _, text in corpus.iter_range(start, min(start + chunk, len(corpus))))
    retriever = bm25_index(texts)
    del texts
    positives = positives_of(dataset, query_ids)
    depth = min(len(corpus), top_k + max(len(p) for p in positives))
    ranked, scores = bm25_rank(retriever, [dataset.queries[q] for q in query_ids], depth)
    table = ance_negatives(-1, query_ids, ranked.astype(np.int64), scores.astype(np.float32),
                           positives, np.zeros(len(query_ids), np.float32), top_k)
    table.sources[table.candidates != PAD] = SOURCE_CODE["bm25"]
    return table


class Bm25Pool(PoolStrategy):
    """Pool ``bm25``: the BM25 table throughout."""

    name: ClassVar[str] = "bm25"
    order: ClassVar[int] = 30
    needs_table: ClassVar[bool] = True
    uses_bm25: ClassVar[bool] = True
    settings_model = Bm25Settings
    legacy_keys = MappingProxyType({"bm25_top_k": "top_k"})

    def check(self, run: RunConfig) -> None:
        if run.negatives.warmup_steps:
            raise ValueError("negatives.warmup_steps: pool bm25 is BM25 throughout; a BM25 "
                             "warm-up goes before another pool (BM25 → X)")

    def source(self, tables: TableHolder,
               random: RandomNegatives) -> tuple[NegativeSource | None, TableId | None]:
        bm25 = tables.bm25
        return (bm25, TableId.bm25()) if bm25 is not None else (None, None)
