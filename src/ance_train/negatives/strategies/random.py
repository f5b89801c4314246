"""Random negatives: documents drawn uniformly from the whole corpus.

Paper: Vladimir Karpukhin, Barlas Oğuz, Sewon Min, Patrick Lewis, Ledell Wu, Sergey Edunov,
Danqi Chen, Wen-tau Yih. "Dense Passage Retrieval for Open-Domain Question Answering". EMNLP
2020. arXiv:2004.04906.

DPR §3.2 ("Positive and negative passages": *Random*, any random passage from the corpus),
the random half of the "BM25 + Rand Neg" baseline of ANCE's Table 1 (arXiv:2007.00808): each
negative is uniform over the corpus minus the query's positives, ``p(d) = 1 / (|C| − |D⁺|)``,
trained with the NLL loss of DPR Eq. 2 (see :mod:`.bm25`). Nothing is mined: the trainer
draws them itself (:class:`RandomNegatives`), so this pool never waits for the indexer.

Pool ``random`` (:class:`RandomPool`).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ance_train.negatives.strategies.base import (
    NegativeSource,
    PerQuerySource,
    PoolStrategy,
    TableHolder,
)
from ance_train.protocol.tables import TableId


class RandomNegatives(PerQuerySource):
    """Uniform over the corpus minus the query's positives ("Rand Neg")."""

    def __init__(self, num_docs: int, positives: dict[str, list[int]]) -> None:
        self.num_docs = num_docs
        self.positives = {qid: set(docs) for qid, docs in positives.items()}

    def sample(self, query_id: str, n: int, rng: np.random.Generator) -> list[int]:
        excluded = self.positives.get(query_id, set())
        n = min(n, self.num_docs - len(excluded))
        picked: list[int] = []
        while len(picked) < n:
            doc = int(rng.integers(self.num_docs))
            if doc not in excluded and doc not in picked:
                picked.append(doc)
        return picked


class RandomPool(PoolStrategy):
    """Pool ``random``: the trainer's own uniform draw."""

    name: ClassVar[str] = "random"
    order: ClassVar[int] = 20

    def source(self, tables: TableHolder,
               random: RandomNegatives) -> tuple[NegativeSource | None, TableId | None]:
        return random, None
