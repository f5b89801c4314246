"""Per-refresh diagnostics the papers rely on, computed by the indexer.

- Overlap of the negatives trained on since the last refresh with the current model's
  top-100 (ANCE §6.3: how stale the asynchronous negatives are).
- Forgetting rate (ANCE-Tele Fig. 4 / 8c): share of a fixed sample of training queries whose
  MRR@100 dropped since the previous refresh.
- Composition of the new negatives by source and by the refresh that first introduced them
  (ANCE-Tele Fig. 9).
"""

from __future__ import annotations

import numpy as np

from ance_train.negatives.mining import align_rows
from ance_train.negatives.rows import Positives, rowwise_isin
from ance_train.negatives.table import PAD, NegativesTable, overlap_at, source_counts


def reciprocal_ranks(ranked: np.ndarray, positives: list[set[int]], depth: int = 100) -> np.ndarray:
    """MRR@depth per query: 1/rank of the first positive in the top ``depth``, else 0."""
    if len(ranked) != len(positives):
        raise ValueError(f"reciprocal_ranks: {len(ranked)} ranked rows, {len(positives)} "
                         "rows of positives")
    hits = rowwise_isin(ranked[:, :depth], Positives.from_rows(positives).dense(slice(None)))
    first = hits.argmax(axis=1)
    return np.where(hits.any(axis=1), 1.0 / (first + 1), 0.0)


class Diagnostics:
    def __init__(self, train_ids: list[str], positives: list[set[int]], seed: int,
                 sample_size: int = 500) -> None:
        self.train_ids = train_ids
        self.positives = positives
        rng = np.random.default_rng(seed)
        count = min(sample_size, len(train_ids))
        self.sample = np.sort(rng.choice(len(train_ids), size=count, replace=False))
        self.previous_mrr: np.ndarray | None = None

    def compute(self, ranked: np.ndarray, in_use: NegativesTable | None,
                new: NegativesTable | None) -> dict:
        """``ranked``: the current model's ranking of every training query (depth ≥ 100)."""
        result: dict = {}
        top100 = ranked[:, :100]
        if in_use is not None:
            used, _ = align_rows(in_use, self.train_ids)
            result["overlap_top100"] = overlap_at(used, top100)
            result["overlap_source_step"] = in_use.step
        mrr = reciprocal_ranks(ranked[self.sample], [self.positives[i] for i in self.sample])
        result["train_sample_mrr@100"] = float(mrr.mean())
        if self.previous_mrr is not None:
            result["forgetting_rate"] = float((mrr < self.previous_mrr).mean())
        self.previous_mrr = mrr
        if new is not None:
            result["composition_by_source"] = source_counts(new)
            assert new.first_seen is not None
            steps, counts = np.unique(new.first_seen[new.candidates != PAD],
                                      return_counts=True)
            result["composition_by_first_seen"] = {str(k): int(v) for k, v in
                                                   zip(steps.tolist(), counts.tolist(),
                                                       strict=True)}
        return result
