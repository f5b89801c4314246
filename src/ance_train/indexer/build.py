"""An index built shard by shard while the inferencers are still encoding its checkpoint.

Without it, an indexer waits for a checkpoint's last shard before reading the first: the whole
build sits between the last ``shard.encoded`` and ``negatives.ready``. With
``index.build_while_encoding`` the indexer adds each corpus shard soon after it is encoded
(an IVF index trains as soon as the shards in hand give it enough vectors:
:class:`ance_train.index.ann.AnnIndex`), so what is left after the last shard is that shard,
the search, the merge and the mining.

Shards go in in shard order only: the next shard is added once it and every shard before it
are in the store. The index then holds the same rows in the same order as one built after the
last shard, so an IVF index trains on the same sample and every search gives the same bits,
whatever order the replicas finish their shards in. Replicas take work first in, first out,
so at most about one shard per replica is out of order at any time.
"""

from __future__ import annotations

import numpy as np

from ance_train.config import IndexConfig
from ance_train.index.ann import AnnIndex


class ShardedBuild:
    """The index of checkpoint ``step`` over ``shards`` (corpus shard numbers, in order),
    ``size`` documents in all; ``shards[:added]`` are in it."""

    def __init__(self, step: int, shards: list[int], size: int, config: IndexConfig) -> None:
        self.step = step
        self.shards = list(shards)
        self.size = size
        self.config = config
        self.index: AnnIndex | None = None
        self.added = 0
        self.added_early = 0  # shards added before the checkpoint was complete (a measurement)

    def next_shard(self) -> int | None:
        """The shard to add next, or None when all are in."""
        return self.shards[self.added] if self.added < len(self.shards) else None

    def add(self, ids: np.ndarray, vectors: np.ndarray, early: bool = False) -> None:
        """Add the vectors of :meth:`next_shard`."""
        if self.next_shard() is None:
            raise ValueError(f"checkpoint {self.step}: every shard is already in the index")
        if self.index is None:
            # Inner product over the model's embeddings as they are: a cosine BiEncoder
            # already returns unit vectors (normalised once, in the model).
            self.index = AnnIndex(vectors.shape[1], self.config, expected_size=self.size)
        self.index.add(ids, vectors)
        self.added += 1
        self.added_early += int(early)

    def finish(self, dim: int) -> AnnIndex:
        """The finalized index, once every shard is in (``dim``: for an index of no shards, a
        partition owning none when there are more partitions than corpus shards)."""
        if self.next_shard() is not None:
            raise ValueError(f"checkpoint {self.step}: shard {self.next_shard()} is not in "
                             "the index yet")
        index = self.index or AnnIndex(dim, self.config, expected_size=0)
        index.finalize()
        return index
