"""In-batch negatives only: the other queries' positives of the batch, no hard negatives.

Paper: Vladimir Karpukhin, Barlas Oğuz, Sewon Min, Patrick Lewis, Ledell Wu, Sergey Edunov,
Danqi Chen, Wen-tau Yih. "Dense Passage Retrieval for Open-Domain Question Answering". EMNLP
2020. arXiv:2004.04906.

DPR §3.2 ("In-batch negatives"): with B queries and their positives in a batch, S = Q·Pᵀ is
the B × B score matrix and each query's B − 1 other positives are its negatives in the NLL
loss of DPR Eq. 2 (ANCE, arXiv:2007.00808, §3.2 shows why such local negatives give
diminishing gradients). The trainer builds these columns for every pool while
``training.in_batch_negatives`` is on (``BatchBuilder``); this pool adds no hard negatives
to them, so nothing is mined and nothing waited for.

Pool ``in_batch`` (:class:`InBatchPool`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from ance_train.negatives.strategies.base import NegativeSource, PoolStrategy, TableHolder
from ance_train.protocol.tables import TableId

if TYPE_CHECKING:
    from ance_train.negatives.strategies.random import RandomNegatives


class InBatchPool(PoolStrategy):
    """Pool ``in_batch``: no hard negatives."""

    name: ClassVar[str] = "in_batch"
    order: ClassVar[int] = 10
    hard_negatives: ClassVar[bool] = False

    def source(self, tables: TableHolder,
               random: RandomNegatives) -> tuple[NegativeSource | None, TableId | None]:
        return None, None
