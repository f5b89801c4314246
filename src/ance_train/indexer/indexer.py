"""The Indexer service: builds the ANN index of each complete checkpoint, mines negatives,
evaluates, and serves Search over the latest index. This module is the loop: it reads the
events into the :class:`~ance_train.indexer.tracker.RefreshTracker` and asks its role what to
build next.

A checkpoint is complete when every shard of its refresh plan is in the store. The indexer
always builds the newest complete checkpoint; if a newer one completes while an older one is
being processed, the older one is abandoned (superseded). Checkpoint 0, the zero-shot
reference, is the exception: while it is planned and not built, it is built first and never
abandoned, however fast the trainer publishes newer checkpoints. A checkpoint with a
``shard.failed`` item (its weights cannot be read) is abandoned, checkpoint 0 included: its
plan is dropped, so newer checkpoints are built instead of waiting for it forever.

Shard events are idempotent: the set of shards received is derived from the store, so
duplicates and late shards of an old checkpoint change nothing. A shard that fails its sha256
check is never indexed: it is deleted and queued to be encoded again, and the checkpoint
waits for it (:mod:`ance_train.indexer.shards`).

The role is chosen once (:mod:`ance_train.indexer.roles`): one indexer builds, then mines,
evaluates and announces (:mod:`ance_train.indexer.announce`). With ``index.partitions: P`` >
1, P processes run this loop, each as one partition (:mod:`ance_train.indexer.partitions`):
it builds the index of the corpus shards it owns, searches every query and stores its top-K
lists (``partition.searched``); partition 0 also merges every partition's lists of the newest
such checkpoint, then mines, evaluates and announces, once (:mod:`ance_train.indexer.merge`).
Search fans out to all partitions (:mod:`ance_train.indexer.search_service`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ance_train.index.ann import use_gpu
from ance_train.indexer.announce import Announcer
from ance_train.indexer.build import ShardedBuild
from ance_train.indexer.merge import PartitionMerger
from ance_train.indexer.partitions import partition_number
from ance_train.indexer.roles import BuildingRole, PartitionRole, SingleIndexRole
from ance_train.indexer.search_service import PartitionDirectory, SearchService
from ance_train.indexer.shards import ShardReader, ShardRequeued
from ance_train.indexer.tracker import RefreshTracker
from ance_train.infra.bus import IDLE_BLOCK_MS, REDIS_UNAVAILABLE, Received
from ance_train.infra.store import StorageError
from ance_train.modeling.checkpoint_cache import ModelCache
from ance_train.protocol import keys
from ance_train.protocol.events import CheckpointPublished, ShardEncoded, ShardFailed
from ance_train.protocol.supersession import Superseded, superseded
from ance_train.protocol.work import RefreshPlan
from ance_train.runtime import ServiceContext


class Indexer:
    """One indexer process: reads the events, keeps the pending checkpoints' state in its
    tracker, and runs its role's work (and partition 0's merge) on the next checkpoint."""

    GROUP = "indexer"

    def __init__(self, ctx: ServiceContext, partition: int | None = None) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self.partitions = partitions = cfg.index.partitions
        self.partition = (partition_number(ctx.options.instance, partitions)
                          if partition is None else partition)
        self.coordinator = self.partition == 0  # merges, mines, evaluates, announces
        # Each partition reads every event: one consumer group per partition.
        self.group = self.GROUP if partitions == 1 else f"{self.GROUP}-{self.partition}"
        self.tracker = RefreshTracker(announces=self.coordinator, partitions=partitions)
        # MaxP: the index holds passages (keys: protocol.embeddings.passage_keys) and is
        # searched through index.passages.PassageIndex, which answers in documents.
        passages = cfg.data.passages
        self.max_passages = passages.max_passages if passages.enabled else None
        use_gpu(cfg.index.device)  # index.device gpu without a FAISS GPU fails at start
        # The encoder (and torch) is loaded on the first text query only (ModelCache).
        self.models = ModelCache(ctx.store, cfg.model, ctx.work_dir / "checkpoints", None)
        directory = (None if partitions == 1 else
                     PartitionDirectory(ctx.bus, self.partition, partitions))
        self.search = SearchService(ctx.corpus, self.models, cfg.model.max_query_length,
                                    directory, cfg.index.search)
        self._last_poll = 0.0
        self.announcer = Announcer(ctx, self.tracker, self.search, self.coordinator)
        self.reader = ShardReader(ctx, self.tracker, self.max_passages)
        # The role, chosen once: the whole index, or this partition's part (+ the merge).
        parts = (ctx, self.tracker, self.reader, self.announcer, self.search, self._cancel_for)
        self.role: BuildingRole = (SingleIndexRole(*parts) if partitions == 1 else
                                   PartitionRole(*parts, self.partition, partitions))
        self.merger = (PartitionMerger(ctx, self.tracker, self.reader, self.announcer,
                                       self._cancel_for, partitions)
                       if partitions > 1 and self.coordinator else None)

    # -- the state (the tracker's and the role's) -------------------------------------------
    @property
    def plans(self) -> dict[int, RefreshPlan]:
        return self.tracker.plans

    @property
    def last_built(self) -> int | None:
        return self.tracker.last_built

    @property
    def build(self) -> ShardedBuild | None:
        return self.role.build

    # -- event handling ---------------------------------------------------------------------
    def recover(self) -> None:
        """Rebuild state from the streams' history and the store (restart-safe).

        The newest checkpoint whose ``negatives.ready`` or ``eval.completed`` went out is the
        last one built; every later published checkpoint is planned again with the shards
        already stored, so one interrupted mid-build is rebuilt from the start (outputs it
        had half-written are overwritten before any event announces them).
        """
        bus, tracker = self.ctx.bus, self.tracker
        self.announcer.recover(bus)  # the last refresh announced, and its table
        self.role.recover(bus)
        for received in bus.history(CheckpointPublished):
            self._add_plan(received)
        if self.coordinator and tracker.plans:  # the timelines of the refreshes under way
            for encoded in bus.history(ShardEncoded):
                tracker.timeline_event(encoded.event)
        for failed in bus.history(ShardFailed):
            self._abandon(failed.event)
        self.ctx.log.info("recovered: last built checkpoint %s, pending %s",
                          "none" if tracker.last_built is None else tracker.last_built,
                          sorted(tracker.plans))
        self.role.recovered()

    def _add_plan(self, received: Received[CheckpointPublished]) -> None:
        step = received.event.step
        self.tracker.add_plan(received, lambda: set(self.ctx.store.list(keys.embeddings(step))))

    def _abandon(self, event: ShardFailed) -> None:
        """Drop the plan of a checkpoint that can never be complete (see ``shard.failed``)."""
        if self.tracker.abandon(event.step):
            self.role.drop(event.step)
            self.ctx.log.error("checkpoint %d abandoned: %s was given up after %s attempts: %s",
                               event.step, event.key, event.attempt, event.error)

    def poll(self, block_ms: int) -> None:
        bus, group = self.ctx.bus, self.group
        for published in bus.consume(CheckpointPublished, group, "indexer", block_ms=0):
            self._add_plan(published)
            bus.ack(CheckpointPublished, group, published.entry_id)
        for failed in bus.consume(ShardFailed, group, "indexer", block_ms=0):
            self._abandon(failed.event)
            bus.ack(ShardFailed, group, failed.entry_id)
        if self.merger is not None:
            self.merger.consume(bus, group)
        for encoded in bus.consume(ShardEncoded, group, "indexer", block_ms=block_ms,
                                   count=256):
            self.tracker.shard_encoded(encoded, self.role.needed)
            bus.ack(ShardEncoded, group, encoded.entry_id)
        self._last_poll = time.monotonic()

    def newest_complete(self) -> int | None:
        """The checkpoint to build next (see :mod:`ance_train.protocol.supersession`): with
        partitions, the newest this partition has every shard of and has not searched."""
        return self.role.newest_complete()

    def encoding_now(self) -> int | None:
        """The checkpoint whose shards are arriving (``RefreshTracker.encoding_now``)."""
        return self.role.encoding_now()

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._run()
        finally:
            self.announcer.tracking.close()

    def _run(self) -> None:
        ctx = self.ctx
        self.recover()
        if ctx.config.negatives.uses_bm25 and self.coordinator:
            self.announcer.publish_bm25_negatives()  # partition 0 mines and announces them
        ctx.state.update(state="idle", phase="waiting for shards",  # Status: -1 = no index
                         index_step=-1 if self.last_built is None else self.last_built)
        self.role.start()
        added = False  # a shard was just added while encoding: read events without waiting
        while not ctx.stop.is_set():
            try:
                self.poll(block_ms=0 if added else IDLE_BLOCK_MS)
            except REDIS_UNAVAILABLE as error:  # back off; the groups keep our place
                ctx.log.warning("reading events failed: %s", error)
                ctx.stop.wait(1.0)
                continue
            if self.merger is not None:
                step = self.merger.newest_mergeable()
                if step is not None:  # announcing a refresh comes before building the next
                    self._attempt(step, self.merger.merge)
                    continue
            step = self.newest_complete()
            if step is not None:
                self._attempt(step, self.role.work)
            added = step is None and self.add_while_encoding()

    def process(self, step: int) -> None:
        """Build ``step`` and do what this process's role does with it."""
        self.role.work(step)

    def add_while_encoding(self) -> bool:
        """No checkpoint is complete: add the next shard of the one being encoded, if it is
        in the store (shards go in in order). Returns whether one was added."""
        next_shard = self.role.add_next_encoded()
        return next_shard is not None and self._attempt(*next_shard)

    def _attempt(self, step: int, work: Callable[[int], None]) -> bool:
        """Run one build (or merge) of ``step``; what may pass is logged and retried later.
        Returns whether the work was done."""
        ctx = self.ctx
        try:
            work(step)
            return True
        except Superseded:
            ctx.log.info("checkpoint %d superseded while indexing", step)
        except ShardRequeued as error:
            ctx.log.warning("checkpoint %d waits for %s to be encoded again", step, error)
        except (*REDIS_UNAVAILABLE, StorageError) as error:
            ctx.log.warning("indexing checkpoint %d failed, will retry: %s", step, error)
            ctx.stop.wait(1.0)
        return False

    def _cancel_for(self, step: int, following: Callable[[], int | None]
                    ) -> Callable[[], None]:
        """The check a build (or merge) of ``step`` calls between batches: raises
        :class:`Superseded` if ``following()``, the next checkpoint to do, supersedes it (a
        newer one completed meanwhile) or the service is stopping."""
        def cancel() -> None:
            if time.monotonic() - self._last_poll > 1.0:
                self.poll(block_ms=0)
            if self.ctx.stop.is_set() or superseded(step, following()):
                raise Superseded(step)
        return cancel


def serve(ctx: ServiceContext) -> int:
    indexer = Indexer(ctx)
    limits = ctx.config.index.search
    return ctx.serve(indexer.run, indexer.search.add_to_server,
                     max_message_bytes=limits.max_message_bytes,
                     max_concurrent_rpcs=limits.max_concurrent_rpcs)
