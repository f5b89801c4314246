"""DANCE: a dual query-retrieval loss next to the document-retrieval one.

Paper: Yizhi Li, Zhenghao Liu, Chenyan Xiong, Zhiyuan Liu. "More Robust Dense Retrieval with
Contrastive Dual Learning". ICTIR 2021. arXiv:2107.07773.

Implements §3.3, Eq. 10 and 12: with L2-normalised embeddings and a temperature τ
(``model.similarity: cosine``, ``model.temperature``; Eq. 6-7), the positive document d⁺ of a
query q⁺ must retrieve q⁺ among negative queries Q⁻_ANN sampled near d⁺:

    L_dual = −log( e^{f(d⁺, q⁺)/τ} / (e^{f(d⁺, q⁺)/τ} + Σ_{q⁻ ∈ Q⁻_ANN} e^{f(d⁺, q⁻)/τ}) )   (10)
    L_final = L_norm + λ · L_dual                                                           (12)

λ = ``negatives.dance.dual_weight`` (0.1 in the paper; 0 disables DANCE). The indexer mines,
at each refresh, the ``dance.top_k`` training queries nearest to each positive document under
the current checkpoint, minus every query that has it as a positive (:func:`mine_dual`); the
trainer draws ``dance.per_positive`` of them per positive (``BatchBuilder``) and adds the
term (``Trainer._optimise``).

A loss strategy: it combines with any pool and sampling.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar

import faiss
import numpy as np
from pydantic import Field

from ance_train.negatives.mining import positives_csr
from ance_train.negatives.rows import Positives
from ance_train.negatives.strategies.base import (
    LossStrategy,
    StrategySettings,
    TableHolder,
    VectorIndex,
)
from ance_train.negatives.table import (
    NegativesTable,
    remove_positives,
    source_codes,
    uniform_probabilities,
)

if TYPE_CHECKING:
    from ance_train.config import NegativesConfig, RunConfig
    from ance_train.data.dataset import DatasetIndex


class DanceSettings(StrategySettings):
    """``negatives.dance``: λ and the negative queries."""

    dual_weight: float = Field(0.0, ge=0.0, description="λ; DANCE: 0.1. 0 disables it.")
    per_positive: int = Field(1, ge=1, description="Negative queries per positive.")
    top_k: int = Field(200, ge=1, description="Negative queries drawn from this top-K.")


def dual_query_negatives(
    positive_docs: Sequence[int] | np.ndarray, ranked_queries: np.ndarray, scores: np.ndarray,
    owners: Mapping[int, set[int]] | Positives, top_k: int, step: int, query_ids: list[str],
) -> NegativesTable:
    """Negative queries of each positive document (Eq. 10's Q⁻_ANN): the training queries
    nearest to it, minus the queries for which it is a positive. Rows are keyed by the
    document index (as a string); candidate ``c`` is the query ``query_ids[c]``, which the
    table carries (``candidate_query_ids``). ``owners``: the training-query rows that have
    each document as a positive, as a mapping document → rows, or as a CSR whose row ``i``
    belongs to ``positive_docs[i]``."""
    docs = np.asarray(positive_docs, dtype=np.int64)
    excluded = (owners if isinstance(owners, Positives)
                else Positives.from_rows([owners.get(int(d), set()) for d in docs]))
    kept, kept_scores = remove_positives(ranked_queries, scores, excluded, top_k)
    return NegativesTable(
        step=step, query_ids=_decimal_strings(docs), candidates=kept,
        scores=kept_scores, positive_scores=np.zeros(len(docs), np.float32),
        probabilities=uniform_probabilities(kept),
        sources=source_codes(kept, "ann"),
        candidate_query_ids=np.array(query_ids, dtype=np.str_))


def _decimal_strings(values: np.ndarray) -> np.ndarray:
    """``np.array([str(v) for v in values])`` without the loop (same narrow string dtype)."""
    text = values.astype(str)
    return text.astype(f"<U{max(1, int(np.char.str_len(text).max(initial=1)))}")


def mine_dual(step: int, config: NegativesConfig, dataset: DatasetIndex, train_ids: list[str],
              index: VectorIndex, train_queries: np.ndarray,
              positives: Positives | None = None) -> NegativesTable:
    """DANCE's negative queries: for each positive document, the nearest training queries
    (embedding space of the current checkpoint) that do not have it as a positive.
    ``positives``: those of ``train_ids`` when the caller keeps them (else read here)."""
    # ignore: strategy sections are pydantic extras (NegativesConfig.__pydantic_extra__),
    # served by BaseModel.__getattr__, which pydantic hides from type checkers.
    top_k = config.dance.top_k  # type: ignore[attr-defined]
    if positives is None:
        positives = positives_csr(dataset, train_ids)
    docs, owners = positives.owners()
    query_index = faiss.IndexFlatIP(train_queries.shape[1])
    query_index.add(np.ascontiguousarray(train_queries, dtype=np.float32))
    depth = min(len(train_ids), top_k + int(owners.counts.max()))
    sims, ranked = query_index.search(np.ascontiguousarray(index.vectors(docs)), depth)
    return dual_query_negatives(docs, ranked.astype(np.int64), sims, owners, top_k, step,
                                train_ids)


class DanceLoss(LossStrategy):
    """The dual loss: enabled by ``negatives.dance.dual_weight`` > 0."""

    name: ClassVar[str] = "dance"
    order: ClassVar[int] = 10
    settings_model = DanceSettings
    legacy_keys = MappingProxyType({"dual_weight": "dual_weight",
                                    "dual_per_positive": "per_positive",
                                    "dual_top_k": "top_k"})

    @property
    def weight(self) -> float:
        """λ of Eq. 12."""
        return self.settings.dual_weight

    @property
    def enabled(self) -> bool:
        return self.weight > 0

    @property
    def per_positive(self) -> int:
        """Negative queries drawn per positive document in a batch."""
        return self.settings.per_positive

    def check(self, run: RunConfig) -> None:
        if self.enabled and run.model.similarity != "cosine":
            raise ValueError("negatives.dance.dual_weight (DANCE) is defined on L2-normalised "
                             "embeddings: set model.similarity to cosine")

    def mine(self, step: int, dataset: DatasetIndex, train_ids: list[str], index: VectorIndex,
             train_queries: np.ndarray) -> NegativesTable:
        """Indexer side, at each refresh: the negative queries of every positive document
        (the positives of ``train_ids`` read once, kept while the indexer passes the same)."""
        cached = getattr(self, "_positives", None)
        if cached is None or cached[0] is not dataset or cached[1] is not train_ids:
            cached = (dataset, train_ids, positives_csr(dataset, train_ids))
            self._positives = cached
        return mine_dual(step, self.config, dataset, train_ids, index, train_queries,
                         cached[2])

    def source(self, tables: TableHolder) -> NegativesTable | None:
        """Trainer side: the newest negative-query table when enabled."""
        return tables.dual if self.enabled else None
