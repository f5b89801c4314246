"""ANCE: hard negatives from an asynchronously refreshed ANN index of the whole corpus.

Paper: Lee Xiong, Chenyan Xiong, Ye Li, Kwok-Fung Tang, Jialin Liu, Paul Bennett, Junaid
Ahmed, Arnold Overwijk. "Approximate Nearest Neighbor Negative Contrastive Learning for Dense
Text Retrieval". ICLR 2021. arXiv:2007.00808.

Implements Eq. 14 of §4,

    θ* = argmin_θ Σ_q Σ_{d⁺ ∈ D⁺} Σ_{d⁻ ∈ D⁻_ANCE} l(f(q, d⁺), f(q, d⁻)),
    D⁻_ANCE = ANN_{f(q, d)} \\ D⁺,

with the §5 setting: negatives sampled uniformly from the top K = 200 (``negatives.top_k``)
of the latest refresh's index, the positives removed, ``p_i = 1 / |D⁻_ANCE(q)|``.

- pool ``ann`` (:class:`AnnPool`): the indexer mines the table at every refresh
  (:meth:`AnnPool.mine`); the trainer draws from the newest table it holds. With
  ``negatives.remine_fraction`` < 1 only a random share of the queries is re-mined per
  refresh and the others keep their previous rows.
- sampling ``uniform`` (:class:`UniformSampling`): the uniform draw above; ANCE-Tele's pool
  uses it too unless SimANS is configured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import numpy as np

from ance_train.negatives.strategies.base import (
    AnnRefresh,
    NegativeSource,
    PoolStrategy,
    SamplingStrategy,
    TableHolder,
)
from ance_train.negatives.table import (
    PAD,
    NegativesTable,
    remove_positives,
    source_codes,
    uniform_probabilities,
)
from ance_train.protocol.tables import TableId

if TYPE_CHECKING:
    from ance_train.config import RunConfig
    from ance_train.negatives.mining import Miner
    from ance_train.negatives.strategies.random import RandomNegatives


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
        sources=source_codes(candidates, "ann"),
    )


def keep_previous_rows(new: NegativesTable, previous: NegativesTable | None,
                       fraction: float, rng: np.random.Generator) -> np.ndarray:
    """ANCE partial re-mining: which rows take the new negatives (True) this refresh.

    A random ``fraction`` of the queries is re-mined; the others keep their previous row
    (queries without a previous row are always mined)."""
    mined = rng.random(len(new)) < fraction
    if previous is None:
        return np.ones(len(new), dtype=bool)
    return mined | (previous.rows_of(new.query_ids) < 0)


def merge_remined(new: NegativesTable, previous: NegativesTable, remined: np.ndarray) -> None:
    """Overwrite, in place, the rows of ``new`` not re-mined with the previous table's rows
    (cut or padded to ``new``'s width: PAD, 0, source -1)."""
    kept = np.flatnonzero(~np.asarray(remined, dtype=bool))
    if not len(kept):
        return
    old = previous.rows_of(new.query_ids[kept])
    if (old < 0).any():
        raise ValueError(f"merge_remined: query {new.query_ids[kept[old < 0][0]]} has no "
                         "previous row to keep: it must be re-mined")
    take = min(new.candidates.shape[1], previous.candidates.shape[1])
    for name, fill in (("candidates", PAD), ("scores", 0), ("probabilities", 0),
                       ("sources", -1), ("first_seen", PAD)):
        target = getattr(new, name)
        target[kept] = fill
        target[kept, :take] = getattr(previous, name)[old][:, :take]


class AnnPool(PoolStrategy):
    """Pool ``ann``: the ANN top-K of the latest refresh minus the positives."""

    name: ClassVar[str] = "ann"
    order: ClassVar[int] = 50
    needs_table: ClassVar[bool] = True
    mines_ann: ClassVar[bool] = True
    remines: ClassVar[bool] = True

    def check(self, run: RunConfig) -> None:
        neg = run.negatives
        if neg.per_query > neg.top_k:
            raise ValueError(f"negatives.per_query ({neg.per_query}) must not exceed "
                             f"negatives.top_k ({neg.top_k})")

    def mine(self, miner: Miner, refresh: AnnRefresh) -> NegativesTable:
        table = miner.table(refresh)
        fraction, previous = self.config.remine_fraction, refresh.previous
        if fraction < 1.0 and previous is not None and previous.step >= 0:
            merge_remined(table, previous,
                          keep_previous_rows(table, previous, fraction, refresh.rng))
        return table

    def source(self, tables: TableHolder,
               random: RandomNegatives) -> tuple[NegativeSource | None, TableId | None]:
        ann = tables.ann
        return (ann, TableId.ann(ann.step)) if ann is not None else (None, None)


class UniformSampling(SamplingStrategy):
    """Sampling ``uniform``: every candidate of a row equally likely (ANCE §5)."""

    name: ClassVar[str] = "uniform"
    order: ClassVar[int] = 10

    def probabilities(self, candidates: np.ndarray, scores: np.ndarray,
                      positive_scores: np.ndarray) -> np.ndarray:
        return uniform_probabilities(candidates)
