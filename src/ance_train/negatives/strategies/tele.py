"""ANCE-Tele: teleportation negatives against catastrophic forgetting between refreshes.

Paper: Si Sun, Chenyan Xiong, Yue Yu, Arnold Overwijk, Zhiyuan Liu, Jie Bao. "Reduce
Catastrophic Forgetting of Dense Retrieval Training with Teleportation Negatives". EMNLP 2022.
arXiv:2210.17167.

Implements Eq. 4-6 of §4, the episode-i negatives

    D_i^Tele = ANN_{f(q, ∘; θ*_{i−1})}            (4: the current ANN negatives)
             + α · D_{i−1}^Tele                    (5: momentum, the previous episode's)
             + β · ANN_{f(d⁺, ∘; θ*_{i−1})}        (6: lookahead, neighbours of the positive)

with Eq. 7: no momentum in episode 0 (a BM25 warm-up table is not an episode). Read as a
mixture of sampling distributions,

    p_i = (p_ann + α · p_{i−1} + β · p_lookahead) / (1 + α + β),

so older episodes fade by α per episode; α = β = 0.5 as in the paper
(``negatives.tele: {momentum_weight, lookahead_weight, max_candidates}``). ``p_ann`` and
``p_lookahead`` are the configured sampling strategy's distributions (uniform, or SimANS)
over the ANN top-k of the query and of ``d̃⁺`` (one positive drawn per query), positives
removed. A document in several parts gets their summed mass and the source of the first
(ann, then momentum, then lookahead); each row keeps its ``max_candidates`` most probable
documents, renormalised.

Pool ``tele`` (:class:`TelePool`): ANCE's ANN pool with the mixture above as its table.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from pydantic import Field

from ance_train.negatives.mining import align_rows
from ance_train.negatives.strategies.ance import AnnPool
from ance_train.negatives.strategies.base import AnnRefresh, StrategySettings
from ance_train.negatives.table import PAD, SOURCE_CODE, NegativesTable, remove_positives

if TYPE_CHECKING:
    from ance_train.negatives.mining import Miner


class TeleSettings(StrategySettings):
    """``negatives.tele``: the weights of Eq. 5-6 and the cap on a row."""

    momentum_weight: float = Field(0.5, ge=0.0, description="α; paper: 0.5.")
    lookahead_weight: float = Field(0.5, ge=0.0, description="β; paper: 0.5.")
    max_candidates: int = Field(
        400, ge=1, description="Cap on a query's teleportation pool (highest probability kept).")


def mix_rows(
    parts: list[tuple[np.ndarray, np.ndarray, int, float]], max_candidates: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mixture of per-row distributions: ``parts`` = [(candidates, probabilities, source, weight)].

    A document in several parts gets the summed mass and the source of the first part that
    holds it. Each row keeps its ``max_candidates`` most probable documents, renormalised.
    """
    rows = parts[0][0].shape[0]
    out_ids = np.full((rows, max_candidates), PAD, dtype=np.int64)
    out_probs = np.zeros((rows, max_candidates), dtype=np.float32)
    out_sources = np.full((rows, max_candidates), -1, dtype=np.int8)
    for row in range(rows):
        mass: dict[int, float] = {}
        source: dict[int, int] = {}
        total_weight = 0.0
        for candidates, probabilities, code, weight in parts:
            valid = candidates[row] != PAD
            if weight <= 0 or not valid.any():
                continue
            total_weight += weight
            for doc, prob in zip(candidates[row][valid], probabilities[row][valid], strict=True):
                mass[int(doc)] = mass.get(int(doc), 0.0) + weight * float(prob)
                source.setdefault(int(doc), code)
        if not mass:
            continue
        ranked = sorted(mass.items(), key=lambda item: -item[1])[:max_candidates]
        kept_total = sum(m for _, m in ranked)
        for column, (doc, m) in enumerate(ranked):
            out_ids[row, column] = doc
            out_probs[row, column] = m / kept_total
            out_sources[row, column] = source[doc]
    return out_ids, out_probs, out_sources


class TelePool(AnnPool):
    """Pool ``tele``: current ANN ∪ α·momentum ∪ β·lookahead (Eq. 4-6)."""

    name: ClassVar[str] = "tele"
    remines: ClassVar[bool] = False
    settings_model = TeleSettings
    legacy_keys = MappingProxyType({"tele_momentum_weight": "momentum_weight",
                                    "tele_lookahead_weight": "lookahead_weight",
                                    "tele_max_candidates": "max_candidates"})

    def mine(self, miner: Miner, refresh: AnnRefresh) -> NegativesTable:
        tele = self.settings
        k, index = refresh.depth, refresh.index
        # Lookahead: neighbours of the positive document, minus the positives themselves.
        near, near_sims = index.search(refresh.anchor_vectors, k + miner.max_positives,
                                       refresh.search_batch, refresh.cancel)
        look, _ = remove_positives(near, near_sims, miner.positives, k)
        look_probs = miner.probabilities(look, miner.scores(index, refresh.queries, look),
                                         refresh.positive_scores)
        parts = [(refresh.candidates, refresh.probabilities, SOURCE_CODE["ann"], 1.0)]
        previous = refresh.previous
        if previous is not None and previous.step >= 0:  # Eq. 7: no momentum in episode 0
            mom, mom_probs = align_rows(previous, miner.train_ids)
            parts.append((mom, mom_probs, SOURCE_CODE["momentum"], tele.momentum_weight))
        parts.append((look, look_probs, SOURCE_CODE["lookahead"], tele.lookahead_weight))
        candidates, probabilities, sources = mix_rows(parts, tele.max_candidates)
        return miner.table(replace(
            refresh, candidates=candidates, probabilities=probabilities, sources=sources,
            scores=miner.scores(index, refresh.queries, candidates)))
