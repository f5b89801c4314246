"""BM25 + random negatives, 1:1: DPR-style training negatives.

Paper: Vladimir Karpukhin, Barlas Oğuz, Sewon Min, Patrick Lewis, Ledell Wu, Sergey Edunov,
Danqi Chen, Wen-tau Yih. "Dense Passage Retrieval for Open-Domain Question Answering". EMNLP
2020. arXiv:2004.04906.

The "DPR (BM25 + Rand Neg)" baseline of ANCE's Table 1 (arXiv:2007.00808, §5: "the 1:1
combination of BM25 and Random negatives"), built from DPR §3.2's *BM25* and *Random*
negative passages: each negative comes from the BM25 table (:mod:`.bm25`) with probability ½
and from the uniform corpus draw (:mod:`.random`) otherwise, trained with the NLL loss of DPR
Eq. 2. It is also the ``warmup: bm25_random`` warm-up ("DPR → X": ANCE §5 warms up from the
DPR checkpoints in OpenQA).

Pool ``bm25_random`` (:class:`Bm25RandomPool`).
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
from ance_train.negatives.strategies.random import RandomNegatives
from ance_train.protocol.tables import TableId


class MixedNegatives(PerQuerySource):
    """Each negative from ``first`` with probability ``share``, else from ``second``
    (DPR's "BM25 + Rand Neg", 1:1)."""

    def __init__(self, first: NegativeSource, second: NegativeSource, share: float = 0.5):
        self.first, self.second, self.share = first, second, share

    def sample(self, query_id: str, n: int, rng: np.random.Generator) -> list[int]:
        picked = self.first.sample(query_id, int(rng.binomial(n, self.share)), rng)
        for doc in self.second.sample(query_id, n, rng):
            if len(picked) == n:
                break
            if doc not in picked:
                picked.append(doc)
        return picked


class Bm25RandomPool(PoolStrategy):
    """Pool ``bm25_random``: BM25 and random negatives 1:1."""

    name: ClassVar[str] = "bm25_random"
    order: ClassVar[int] = 40
    needs_table: ClassVar[bool] = True
    uses_bm25: ClassVar[bool] = True

    def source(self, tables: TableHolder,
               random: RandomNegatives) -> tuple[NegativeSource | None, TableId | None]:
        if tables.bm25 is None:
            return None, None
        return MixedNegatives(tables.bm25, random), TableId.bm25()
