"""Where a training step draws its hard negatives from.

Every source answers ``sample(query_id, n, rng) -> list[int]`` (document indices, never a
positive of the query) and ``sample_many(query_ids, n, rng)`` for a whole batch. A
:class:`~ance_train.negatives.table.NegativesTable` is one; the
others are the DPR-style baselines the ANCE paper compares against (its Table 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ance_train.config import NegativesConfig
from ance_train.negatives.table import NegativesTable


class NegativeSource(Protocol):
    def sample(self, query_id: str, n: int, rng: np.random.Generator) -> list[int]: ...

    def sample_many(self, query_ids: Sequence[str], n: int,
                    rng: np.random.Generator) -> list[list[int]]: ...


class _PerQuery:
    """``sample_many`` as one ``sample`` per query (sources without a vectorised draw)."""

    def sample(self, query_id: str, n: int, rng: np.random.Generator) -> list[int]:
        raise NotImplementedError

    def sample_many(self, query_ids: Sequence[str], n: int,
                    rng: np.random.Generator) -> list[list[int]]:
        return [self.sample(query_id, n, rng) for query_id in query_ids]


class RandomNegatives(_PerQuery):
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


class MixedNegatives(_PerQuery):
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


class TableHolder(Protocol):
    """What the picker needs from the negatives feed."""

    bm25: NegativesTable | None
    ann: NegativesTable | None


class NegativesPicker:
    """Chooses the source of each step from the pool, the BM25 warm-up and the tables held."""

    def __init__(self, config: NegativesConfig, tables: TableHolder, random: RandomNegatives):
        self.config = config
        self.tables = tables
        self.random = random

    def _warming(self, step: int) -> bool:
        """BM25 warm-up ("BM25 → X", ANCE Table 1): the first ``warmup_steps`` steps, and for
        ANN pools also every step until the first ANN table has arrived."""
        cfg = self.config
        if cfg.warmup == "none":
            return False
        return step <= cfg.warmup_steps or (cfg.mines_ann and self.tables.ann is None)

    def pick(self, step: int) -> tuple[NegativeSource | None, int | None]:
        """The source for ``step`` and the step of the table it comes from (-1: BM25)."""
        cfg, bm25, ann = self.config, self.tables.bm25, self.tables.ann
        if cfg.per_query == 0:
            return None, None
        if self._warming(step) and bm25 is not None:
            if cfg.warmup == "bm25_random":
                return MixedNegatives(bm25, self.random), -1
            return bm25, -1
        if cfg.pool == "in_batch":
            return None, None
        if cfg.pool == "random":
            return self.random, None
        if cfg.pool == "bm25":
            return bm25, (-1 if bm25 is not None else None)
        if cfg.pool == "bm25_random":
            if bm25 is None:
                return None, None
            return MixedNegatives(bm25, self.random), -1
        if ann is not None:
            return ann, ann.step
        return None, None

    def needs_wait(self) -> bool:
        """Whether step 1 has a table to wait for (``negatives.wait_for_first``)."""
        cfg = self.config
        if not cfg.wait_for_first or cfg.per_query == 0:
            return False
        return self._warming(1) or cfg.pool not in ("in_batch", "random")

    def ready(self) -> bool:
        """Whether the source meant for step 1 is there."""
        if self._warming(1):
            return self.tables.bm25 is not None
        return self.pick(1)[0] is not None
