"""Partition 0's merge (``index.partitions`` > 1): once every partition's top-K lists of a
checkpoint are stored, merge them into the global top-K and hand them to the
:class:`~ance_train.indexer.announce.Announcer` (mine, evaluate, announce), once.
"""

from __future__ import annotations

import time

import numpy as np

from ance_train.index.merge import merge_topk
from ance_train.index.passages import PassageIndex
from ance_train.indexer.announce import Announcer
from ance_train.indexer.partitions import MergedIndex
from ance_train.indexer.roles import CancelFor
from ance_train.indexer.shards import ShardReader
from ance_train.indexer.tracker import RefreshTracker
from ance_train.infra.bus import EventBus
from ance_train.protocol import keys
from ance_train.protocol.events import PartitionSearched
from ance_train.protocol.partials import TopK, unpack_partials
from ance_train.runtime import ServiceContext


class PartitionMerger:
    """Partition 0: reads the other partitions' ``partition.searched``, merges the newest
    checkpoint whose lists are all stored and announces its refresh."""

    def __init__(self, ctx: ServiceContext, tracker: RefreshTracker, reader: ShardReader,
                 announcer: Announcer, cancel_for: CancelFor, partitions: int) -> None:
        self.ctx = ctx
        self.tracker = tracker
        self.reader = reader
        self.announcer = announcer
        self.cancel_for = cancel_for
        self.partitions = partitions

    def consume(self, bus: EventBus, group: str) -> None:
        """Note the ``partition.searched`` events that came in."""
        for searched in bus.consume(PartitionSearched, group, "indexer", block_ms=0):
            self.tracker.partition_searched(searched.event)
            bus.ack(PartitionSearched, group, searched.entry_id)

    def newest_mergeable(self) -> int | None:
        return self.tracker.newest_mergeable()

    def merge(self, step: int) -> None:
        """Merge every partition's lists of ``step`` into the global top-K, mine, evaluate
        and announce the refresh (once: the announcement is what ``Indexer.recover`` reads
        back, and a merge redone after a restart rewrites the same objects)."""
        ctx, cfg = self.ctx, self.ctx.config
        cancel = self.cancel_for(step, self.newest_mergeable)
        started = time.monotonic()
        # The partitions built and searched; here "index build" is reading their lists and
        # "search" is empty (their build_s / search_s are in the timings).
        marks: dict[str, float] = {"build_started_at": time.time()}
        ctx.state.update(state="running", phase=f"merging {step}", checkpoint_step=step)
        plan = self.tracker.plans[step]
        parts = []
        for partition in range(self.partitions):
            cancel()
            key = keys.partial_results(step, partition, self.partitions)
            parts.append(unpack_partials(ctx.store.get_bytes(key)))
        merged: dict[str, TopK] = {}
        for name, first in parts[0].groups.items():
            for partition, part in enumerate(parts):
                if name not in part.groups or not np.array_equal(part.groups[name].query_ids,
                                                                 first.query_ids):
                    raise ValueError(f"checkpoint {step}: partition {partition}'s lists of "
                                     f"{name!r} are not of the queries of partition 0's")
            depth = self.announcer.train_depth() if name == "train" else cfg.index.eval_depth
            merged[name] = TopK(first.query_ids, *merge_topk(
                [(part.groups[name].ids, part.groups[name].scores) for part in parts], depth))
        queries = self.reader.queries(step, plan)
        dim = queries.vectors.shape[1]
        known = (np.concatenate([part.doc_ids for part in parts]),
                 np.concatenate([part.doc_vectors.reshape(-1, dim) for part in parts]))
        max_passages = self.reader.max_passages
        merged_rows = MergedIndex(ctx.store, plan, dim, known=known, max_passages=max_passages)
        view = (merged_rows if max_passages is None
                else PassageIndex(merged_rows, max_passages, plan.num_docs))
        merge_s = time.monotonic() - started
        marks["built_at"] = marks["searched_at"] = time.time()
        events = self.tracker.searched[step].values()
        timings = {"build_s": max(e.build_s for e in events),
                   "search_s": max(e.search_s for e in events),
                   "shards_added_early": float(sum(e.shards_added_early for e in events)),
                   "merge_s": merge_s}
        self.announcer.refresh(step, view, queries, cancel, marks, timings, merged, announcing=(
            lambda: ctx.log.info("checkpoint %d: merged %d partitions' lists (%d corpus shards "
                                 "read back for vectors)", step, self.partitions,
                                 merged_rows.shards_read)))
