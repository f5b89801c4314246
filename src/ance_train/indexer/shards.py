"""Reading a refresh's embedding shards from the store: corpus shards into the index, the
query vectors by query id, and a shard that fails its checksum deleted and queued again.
"""

from __future__ import annotations

import numpy as np

from ance_train.indexer.tracker import RefreshTracker
from ance_train.infra.bus import WorkQueue
from ance_train.infra.store import CorruptObject
from ance_train.protocol.embeddings import unpack_embeddings, unpack_rows
from ance_train.protocol.work import RefreshPlan, ShardKind
from ance_train.runtime import ServiceContext


class QueryVectors:
    """The query vectors of a refresh, looked up by query id."""

    def __init__(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        self.vectors = vectors
        self.row = {str(qid): row for row, qid in enumerate(ids)}

    def of(self, query_ids: list[str]) -> np.ndarray:
        """The vectors of ``query_ids``, in that order (KeyError names a missing query)."""
        return self.vectors[np.array([self.row[q] for q in query_ids], dtype=np.int64)]


class ShardRequeued(Exception):
    """A shard failed its checksum: it was deleted and queued to be encoded again."""


class ShardReader:
    """The shards of the plans ``tracker`` holds. ``max_passages``: MaxP, the corpus shards
    hold passages (keys: protocol.embeddings.passage_keys)."""

    def __init__(self, ctx: ServiceContext, tracker: RefreshTracker,
                 max_passages: int | None) -> None:
        self.ctx = ctx
        self.tracker = tracker
        self.max_passages = max_passages
        self.work_queue = WorkQueue(ctx.bus, ctx.config.inference.claim_timeout_s)

    def queries(self, step: int, plan: RefreshPlan) -> QueryVectors:
        """Every encoded query's vector, by query id (the shards carry the ids)."""
        parts = [self.shard(step, ShardKind.QUERIES, shard)
                 for shard in range(len(plan.query_ranges))]
        return QueryVectors(np.concatenate([ids for ids, _ in parts]),
                            np.concatenate([vectors for _, vectors in parts]))

    def shard(self, step: int, kind: ShardKind, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """A shard's ids and vectors. One that fails its checksum is never used: it is deleted
        and queued again, and the checkpoint is complete again once it is re-encoded."""
        work = self.tracker.plans[step].work(kind)[shard]
        try:
            data = self.ctx.store.get_bytes(work.key)
            if kind is ShardKind.CORPUS:  # documents, or MaxP passages
                return unpack_rows(data, self.max_passages)
            return unpack_embeddings(data)
        except CorruptObject as error:
            self.ctx.log.error("%s; deleting it and queuing %s@%d again", error, work.name, step)
            self.tracker.received[step].discard(work.key)
            self.ctx.store.delete(work.key)
            self.work_queue.enqueue([work])
            raise ShardRequeued(work.key) from error
