"""Where a training step draws its hard negatives from.

Every source answers ``sample(query_id, n, rng) -> list[int]`` (document indices, never a
positive of the query) and ``sample_many(query_ids, n, rng)`` for a whole batch
(:class:`~ance_train.negatives.strategies.base.NegativeSource`). Each pool strategy gives
its own (``PoolStrategy.source``: a table the feed holds, or a draw of the trainer's own);
the picker here chooses, per step, between the BM25 warm-up and the configured pool.
"""

from __future__ import annotations

from typing import cast

from ance_train.config import NegativesConfig
from ance_train.negatives.strategies.base import NegativeSource, PoolStrategy, TableHolder
from ance_train.negatives.strategies.random import RandomNegatives
from ance_train.protocol.tables import TableId

__all__ = ["NegativeSource", "NegativesPicker", "TableHolder"]


class NegativesPicker:
    """Chooses the source of each step from the pool, the BM25 warm-up and the tables held.

    The warm-up (``negatives.warmup``) is itself a pool (``bm25`` or ``bm25_random``) whose
    source is used first, as long as its table is there.
    """

    def __init__(self, config: NegativesConfig, tables: TableHolder, random: RandomNegatives):
        self.config = config
        self.tables = tables
        self.random = random
        self.pool = config.pool_strategy
        # The cast: a warm-up (``bm25``, ``bm25_random``) is a registered pool strategy.
        self.warmup = (None if config.warmup == "none"
                       else cast(PoolStrategy, config.strategy(config.warmup)))

    def _warming(self, step: int) -> bool:
        """BM25 warm-up ("BM25 → X", ANCE Table 1): the first ``warmup_steps`` steps, and for
        ANN pools also every step until the first ANN table has arrived."""
        if self.warmup is None:
            return False
        return step <= self.config.warmup_steps or (self.pool.mines_ann
                                                     and self.tables.ann is None)

    def pick(self, step: int) -> tuple[NegativeSource | None, TableId | None]:
        """The source for ``step`` and the table it comes from (None: not a table)."""
        if self.config.per_query == 0:
            return None, None
        if self._warming(step):
            assert self.warmup is not None  # ``_warming`` is False without one
            source, table = self.warmup.source(self.tables, self.random)
            if source is not None:
                return source, table
        return self.pool.source(self.tables, self.random)

    def needs_wait(self) -> bool:
        """Whether step 1 has a table to wait for (``negatives.wait_for_first``)."""
        cfg = self.config
        if not cfg.wait_for_first or cfg.per_query == 0:
            return False
        return self._warming(1) or self.pool.needs_table

    def ready(self) -> bool:
        """Whether the source meant for step 1 is there."""
        if self._warming(1):
            assert self.warmup is not None  # ``_warming`` is False without one
            return self.warmup.source(self.tables, self.random)[0] is not None
        return self.pick(1)[0] is not None
