"""The Indexer service: builds the ANN index of each complete checkpoint, mines negatives,
evaluates, and serves Search over the latest index.

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
waits for it.

With ``index.partitions: P`` > 1, P indexer processes run this loop, each as one partition
(:mod:`ance_train.indexer.partitions`): partition ``p`` waits for the corpus shards it owns
and every query shard, builds its own index of them, searches every training and evaluation
query and stores its local top-K lists (``partition.searched``). Partition 0 also merges: once
the lists of every partition are stored for a checkpoint (the newest such, by the same
supersession rule), it merges them, mines, evaluates and announces the refresh, once. Each
partition serves Search over its own index, and fans a user's Search out to all partitions
(:mod:`ance_train.indexer.search_service`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import numpy as np

from ance_train.evaluation import CI_MEASURE, evaluate_with_interval, format_interval
from ance_train.index.ann import AnnIndex, use_gpu
from ance_train.index.merge import merge_topk
from ance_train.index.passages import PassageIndex
from ance_train.indexer.build import ShardedBuild
from ance_train.indexer.diagnostics import Diagnostics
from ance_train.indexer.partitions import MergedIndex, partition_number
from ance_train.indexer.search_service import PartitionDirectory, SearchService, ServedIndex
from ance_train.infra.bus import REDIS_UNAVAILABLE, Received, WorkQueue, entry_seconds
from ance_train.infra.retention import RunRetention
from ance_train.infra.store import CorruptObject, StorageError
from ance_train.modeling.checkpoint_cache import ModelCache
from ance_train.negatives.mining import Miner, positives_of
from ance_train.negatives.strategies.bm25 import bm25_negatives
from ance_train.negatives.table import NegativesTable, store_table
from ance_train.observability.telemetry import IndexerTelemetry
from ance_train.observability.timeline import refresh_timeline
from ance_train.observability.timeline import scalars as timeline_scalars
from ance_train.observability.tracking import Tracking, flatten, open_tracking
from ance_train.protocol import keys
from ance_train.protocol.embeddings import unpack_embeddings, unpack_rows
from ance_train.protocol.events import (
    CheckpointPublished,
    EvalCompleted,
    IndexerTimes,
    NegativesReady,
    PartitionSearched,
    ShardEncoded,
    ShardFailed,
)
from ance_train.protocol.partials import TopK, pack_partials, unpack_partials
from ance_train.protocol.supersession import Superseded, next_to_build, superseded
from ance_train.protocol.tables import TableId, TableKind
from ance_train.protocol.work import ZERO_SHOT_STEP, RefreshPlan, ShardKind
from ance_train.runtime import ServiceContext

if TYPE_CHECKING:
    from ance_train.negatives.strategies.base import VectorIndex
    from ance_train.negatives.strategies.dance import DanceLoss


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


class Indexer:
    GROUP = "indexer"

    def __init__(self, ctx: ServiceContext, partition: int | None = None) -> None:
        self.ctx = ctx
        self.partitions = ctx.config.index.partitions
        self.partition = (partition_number(ctx.options.instance, self.partitions)
                          if partition is None else partition)
        self.coordinator = self.partition == 0  # merges, mines, evaluates, announces
        # Each partition reads every event: one consumer group per partition.
        self.group = self.GROUP if self.partitions == 1 else f"{self.GROUP}-{self.partition}"
        self.last_searched: int | None = None  # P > 1: this partition's newest stored lists
        # P > 1, partition 0: checkpoint -> partition -> its partition.searched
        self.searched: dict[int, dict[int, PartitionSearched]] = {}
        self.plans: dict[int, RefreshPlan] = {}  # published, not yet built or abandoned
        self.received: dict[int, set[str]] = {}
        self.published_at: dict[int, float] = {}  # Redis server time of checkpoint.published
        # Redis server time of the shard.encoded that completed this process's part of a plan
        self.completed_at: dict[int, float] = {}
        # The refresh timeline (observability/timeline.py): each pending checkpoint's
        # checkpoint.published and the shard.encoded of its shards, by key.
        self.published: dict[int, CheckpointPublished] = {}
        self.shard_events: dict[int, dict[str, ShardEncoded]] = {}
        self.completed_wall: dict[int, float] = {}  # Unix time this process read it complete
        self.build: ShardedBuild | None = None  # the index being built, maybe while encoding
        # MaxP: the index holds passages (keys: protocol.embeddings.passage_keys) and is
        # searched through index.passages.PassageIndex, which answers in documents.
        passages = ctx.config.data.passages
        self.max_passages = passages.max_passages if passages.enabled else None
        self.last_built: int | None = None
        self.abandoned: set[int] = set()  # checkpoints with a shard.failed item
        self.train_ids = sorted(ctx.dataset.train)
        # The training positives: each partition sends the vectors of those it owns with its
        # lists (the anchors and DANCE's documents the merge mines with).
        self.positive_docs = np.array(sorted({d for q in self.train_ids
                                              for d in ctx.dataset.positives(q)}),
                                      dtype=np.int64)
        cfg = ctx.config
        self.miner = Miner(cfg.negatives, cfg.model.temperature, ctx.dataset, self.train_ids,
                           cfg.training.seed)
        # DANCE's negative queries (when on); the cast: the registry's "dance" is DanceLoss.
        self.dance = cast("DanceLoss", cfg.negatives.strategy("dance"))
        self.diagnostics = Diagnostics(self.train_ids, positives_of(ctx.dataset, self.train_ids),
                                       cfg.training.seed)
        self.previous: NegativesTable | None = None
        use_gpu(cfg.index.device)  # index.device gpu without a FAISS GPU fails at start
        # The encoder (and torch) is loaded on the first text query only (ModelCache).
        self.models = ModelCache(ctx.store, ctx.config.model, ctx.work_dir / "checkpoints", None)
        directory = (None if self.partitions == 1 else
                     PartitionDirectory(ctx.bus, self.partition, self.partitions))
        self.search = SearchService(ctx.corpus, self.models, ctx.config.model.max_query_length,
                                    directory, cfg.index.search)
        self._last_poll = 0.0
        self.telemetry = IndexerTelemetry(ctx.reporter)
        # Partition 0 reports the refreshes; the other partitions have no scalars to track.
        self.tracking = (open_tracking(cfg, "indexer", ctx.store, ctx.work_dir)
                         if self.coordinator else Tracking([]))
        self.work_queue = WorkQueue(ctx.bus, ctx.config.inference.claim_timeout_s)
        # store.keep_refreshes: the indexer alone deletes per-refresh objects (retention.py).
        self.retention = RunRetention(ctx.bus, ctx.store, cfg.store.keep_refreshes, None)

    # -- event handling ---------------------------------------------------------------------
    def recover(self) -> None:
        """Rebuild state from the streams' history and the store (restart-safe).

        The newest checkpoint whose ``negatives.ready`` or ``eval.completed`` went out is the
        last one built; every later published checkpoint is planned again with the shards
        already stored, so one interrupted mid-build is rebuilt from the start (outputs it
        had half-written are overwritten before any event announces them).
        """
        bus = self.ctx.bus
        done = [r.event for r in bus.history(NegativesReady) if r.event.step is not None]
        evaluated = [r.event.step for r in bus.history(EvalCompleted)]
        built = [e.step for e in done if e.step is not None] + evaluated
        self.last_built = max(built, default=None)
        latest = max(done, key=lambda e: e.step or 0, default=None)
        table = None if latest is None else latest.table(TableKind.ANN)
        if table is not None and self.coordinator:
            self.previous = NegativesTable.from_bytes(self.ctx.store.get_bytes(table.key))
        if self.partitions > 1:
            for searched in bus.history(PartitionSearched):
                event = searched.event
                if event.partitions != self.partitions:
                    continue  # lists of another partitioning (index.partitions changed)
                if event.partition == self.partition:
                    self.last_searched = max(event.step, self.last_searched or 0)
                self._partition_searched(event)
        for received in bus.history(CheckpointPublished):
            self._add_plan(received)
        if self.coordinator and self.plans:  # the timelines of the refreshes under way
            for encoded in bus.history(ShardEncoded):
                if encoded.event.step in self.plans:
                    self.shard_events.setdefault(encoded.event.step, {})[
                        encoded.event.key] = encoded.event
        for failed in bus.history(ShardFailed):
            self._abandon(failed.event)
        self.ctx.log.info("recovered: last built checkpoint %s, pending %s",
                          "none" if self.last_built is None else self.last_built,
                          sorted(self.plans))
        if self.partitions > 1:
            self.ctx.log.info("partition %d of %d: last searched checkpoint %s", self.partition,
                              self.partitions,
                              "none" if self.last_searched is None else self.last_searched)

    def _built(self, step: int) -> bool:
        """Was the refresh of ``step`` (or a newer one) announced?"""
        return self.last_built is not None and step <= self.last_built

    def _searched(self, step: int) -> bool:
        """P > 1: has this partition stored its lists of ``step`` (or a newer one), or is the
        refresh already announced?"""
        return self._built(step) or (self.last_searched is not None
                                     and step <= self.last_searched)

    def _partition_searched(self, event: PartitionSearched) -> None:
        """Partition 0 notes which partitions stored their lists of which checkpoint."""
        if (self.coordinator and event.partitions == self.partitions
                and not self._built(event.step)):
            self.searched.setdefault(event.step, {})[event.partition] = event

    def _needed(self, plan: RefreshPlan) -> set[str]:
        """The shards this process waits for before it builds ``plan``."""
        if self.partitions == 1:
            return plan.expected_keys()
        return plan.partition_keys(self.partition, self.partitions)

    def _add_plan(self, received: Received[CheckpointPublished]) -> None:
        step = received.event.step
        if step in self.plans or self._built(step) or step in self.abandoned:
            return  # a duplicate or stale event
        if not self.coordinator and self._searched(step):
            return  # this partition's part is done; partition 0 keeps plans until merged
        self.published_at[step] = entry_seconds(received.entry_id)
        self.published[step] = received.event
        self.plans[step] = received.event.plan
        # Shards already in the store count (an indexer restarted mid-refresh loses nothing).
        self.received[step] = set(self.ctx.store.list(keys.embeddings(step)))

    def _abandon(self, event: ShardFailed) -> None:
        """Drop the plan of a checkpoint that can never be complete (see ``shard.failed``)."""
        step = event.step
        plan = self.plans.get(step)
        if self._built(step) or step in self.abandoned or (
                plan is not None and plan.expected_keys() <= self.received.get(step, set())):
            return  # built, already abandoned, or complete after all (another replica's copy)
        self.abandoned.add(step)
        self._forget(step)
        self.searched.pop(step, None)
        if self.build is not None and self.build.step == step:
            self.build = None
        self.ctx.log.error("checkpoint %d abandoned: %s was given up after %s attempts: %s",
                           step, event.key, event.attempt, event.error)

    def poll(self, block_ms: int) -> None:
        bus, group = self.ctx.bus, self.group
        for published in bus.consume(CheckpointPublished, group, "indexer", block_ms=0):
            self._add_plan(published)
            bus.ack(CheckpointPublished, group, published.entry_id)
        for failed in bus.consume(ShardFailed, group, "indexer", block_ms=0):
            self._abandon(failed.event)
            bus.ack(ShardFailed, group, failed.entry_id)
        if self.partitions > 1 and self.coordinator:
            for searched in bus.consume(PartitionSearched, group, "indexer", block_ms=0):
                self._partition_searched(searched.event)
                bus.ack(PartitionSearched, group, searched.entry_id)
        for encoded in bus.consume(ShardEncoded, group, "indexer", block_ms=block_ms,
                                   count=256):
            step = encoded.event.step
            if not self._built(step):
                received = self.received.setdefault(step, set())
                received.add(encoded.event.key)
                plan = self.plans.get(step)
                if self.coordinator:  # may come before its checkpoint.published is read
                    self.shard_events.setdefault(step, {})[encoded.event.key] = encoded.event
                if (plan is not None and step not in self.completed_at
                        and self._needed(plan) <= received):
                    self.completed_at[step] = entry_seconds(encoded.entry_id)
                    self.completed_wall[step] = time.time()
            bus.ack(ShardEncoded, group, encoded.entry_id)
        self._last_poll = time.monotonic()

    def newest_complete(self) -> int | None:
        """The checkpoint to build next (see :mod:`ance_train.protocol.supersession`): with
        partitions, the newest this partition has every shard of and has not searched."""
        if self.partitions == 1:
            complete = {step: plan.expected_keys() <= self.received.get(step, set())
                        for step, plan in self.plans.items()}
            return next_to_build(complete, self.last_built)
        complete = {step: self._needed(plan) <= self.received.get(step, set())
                    for step, plan in self.plans.items() if not self._searched(step)}
        return next_to_build(complete, self.last_searched)

    def newest_mergeable(self) -> int | None:
        """Partition 0: the checkpoint to merge and announce next, among those not announced,
        by the same rule; complete = every partition's lists are stored."""
        ready = {step: len(self.searched.get(step, {})) == self.partitions
                 for step in self.plans if not self._built(step)}
        return next_to_build(ready, self.last_built)

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._run()
        finally:
            self.tracking.close()

    def _run(self) -> None:
        ctx = self.ctx
        self.recover()
        if ctx.config.negatives.uses_bm25:
            self.publish_bm25_negatives()
        ctx.state.update(state="idle", phase="waiting for shards",  # Status: -1 = no index
                         index_step=-1 if self.last_built is None else self.last_built)
        if self.partitions > 1:
            assert self.search.directory is not None  # made when partitions > 1
            self.search.directory.start(ctx)  # where Search fans out to
        added = False  # a shard was just added while encoding: read events without waiting
        while not ctx.stop.is_set():
            try:
                self.poll(block_ms=0 if added else 500)
            except REDIS_UNAVAILABLE as error:  # back off; the groups keep our place
                ctx.log.warning("reading events failed: %s", error)
                ctx.stop.wait(1.0)
                continue
            if self.partitions > 1 and self.coordinator:
                step = self.newest_mergeable()
                if step is not None:  # announcing a refresh comes before building the next
                    self._attempt(step, self.merge)
                    continue
            step = self.newest_complete()
            if step is not None:
                self._attempt(step, self.process if self.partitions == 1 else self.build_part)
            added = step is None and self.add_while_encoding()

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

    # -- building while the inferencers encode (ance_train.indexer.build) ------------------
    def encoding_now(self) -> int | None:
        """The checkpoint whose shards are arriving: checkpoint 0 while it is pending (it is
        built first), else the pending one with the most of this process's shards in the
        store (the refresh under way; a tie goes to the newest)."""
        pending = [step for step in self.plans if not self._searched(step)]
        if not pending:
            return None
        if ZERO_SHOT_STEP in pending:
            return ZERO_SHOT_STEP
        return max(pending, key=lambda step: (
            len(self._needed(self.plans[step]) & self.received.get(step, set())), step))

    def build_of(self, step: int) -> ShardedBuild:
        """The build of ``step`` under way, else a new one. One build at a time bounds the
        memory: a partial build of another checkpoint is dropped."""
        if self.build is not None and self.build.step != step:
            self.ctx.log.info("dropping the partial index of checkpoint %d (%d of %d shards): "
                              "building %d", self.build.step, self.build.added,
                              len(self.build.shards), step)
            self.build = None
        if self.build is None:
            plan = self.plans[step]
            shards = (list(range(len(plan.corpus_ranges))) if self.partitions == 1
                      else plan.owned_shards(self.partition, self.partitions))
            size = sum(plan.corpus_ranges[shard][1] - plan.corpus_ranges[shard][0]
                       for shard in shards)
            self.build = ShardedBuild(step, shards, size, self.ctx.config.index)
        return self.build

    def _add_next(self, build: ShardedBuild, early: bool = False) -> None:
        shard = build.next_shard()
        assert shard is not None
        ids, vectors = self._load_shard(build.step, ShardKind.CORPUS, shard)
        build.add(ids, vectors, early)

    def _documents(self, index: AnnIndex, step: int, shards: list[int]
                   ) -> AnnIndex | PassageIndex:
        """``index`` as the rest of the indexer searches it: by documents (MaxP: its
        passages collapsed to documents, ``shards`` telling how many documents it holds)."""
        if self.max_passages is None:
            return index
        ranges = self.plans[step].corpus_ranges
        return PassageIndex(index, self.max_passages,
                            sum(ranges[s][1] - ranges[s][0] for s in shards))

    def add_while_encoding(self) -> bool:
        """No checkpoint is complete: add the next shard of the one being encoded, if it is
        in the store (shards go in in order). Returns whether one was added."""
        if not self.ctx.config.index.build_while_encoding:
            return False
        step = self.encoding_now()
        if step is None:
            return False
        build = self.build_of(step)
        shard = build.next_shard()
        if shard is None or (self.plans[step].work(ShardKind.CORPUS)[shard].key
                             not in self.received.get(step, set())):
            return False
        # The phase says so (Status), the state stays: this is work between events.
        self.ctx.state.update(phase=f"building index {step}")
        return self._attempt(step, lambda _: self._add_next(build, early=True))

    def _index(self, step: int, cancel: Callable[[], None]
               ) -> tuple[AnnIndex | PassageIndex, QueryVectors, int]:
        """``step``'s index over this process's shards (those added while encoding and the
        rest), its query vectors and how many shards went in while encoding."""
        build = self.build_of(step)
        while build.next_shard() is not None:
            cancel()
            self._add_next(build)
        queries = self._load_queries(step, self.plans[step])
        index = self._documents(build.finish(queries.vectors.shape[1]), step, build.shards)
        self.build = None
        return index, queries, build.added_early

    def _check_superseded(self, step: int, merging: bool = False) -> None:
        """Called between batches of a build: raises :class:`Superseded` if a newer
        checkpoint completed meanwhile (or the service is stopping). ``merging``: partition
        0's merge, overtaken when a newer checkpoint has every partition's lists."""
        if time.monotonic() - self._last_poll > 1.0:
            self.poll(block_ms=0)
        following = self.newest_mergeable() if merging else self.newest_complete()
        if self.ctx.stop.is_set() or superseded(step, following):
            raise Superseded(step)

    def publish_bm25_negatives(self) -> None:
        ctx = self.ctx
        if not self.coordinator:
            return  # partition 0 mines and announces them once
        table_id = TableId.bm25()
        key = table_id.key
        if not ctx.store.exists(key):
            ctx.state.update(state="running", phase="BM25 negatives")
            started = time.monotonic()
            # ignore: the ``bm25`` section is a pydantic extra of NegativesConfig (as in
            # strategies/dance.py), which mypy cannot see.
            table = bm25_negatives(ctx.corpus, ctx.dataset, self.train_ids,
                                   ctx.config.negatives.bm25.top_k)  # type: ignore[attr-defined]
            store_table(ctx.store, key, table, ctx.work_dir)
            if self.previous is None:  # what the trainer uses until the first ANN refresh
                self.previous = table
            ctx.log.info("BM25 negatives for %d queries in %.1fs", len(table),
                         time.monotonic() - started)
        elif self.previous is None:  # restarted before the first ANN refresh
            self.previous = NegativesTable.from_bytes(ctx.store.get_bytes(key))
        ctx.bus.publish(NegativesReady(tables=(table_id,)))

    def process(self, step: int) -> None:
        ctx = self.ctx
        cancel = lambda: self._check_superseded(step)  # noqa: E731
        started = time.monotonic()
        marks: dict[str, float] = {"build_started_at": time.time()}  # the refresh timeline
        ctx.state.update(state="running", phase=f"building index {step}", checkpoint_step=step)
        index, queries, early = self._index(step, cancel)
        build_s = time.monotonic() - started
        marks["built_at"] = time.time()

        ctx.state.update(phase=f"mining {step}")
        started = time.monotonic()
        table, dual, diagnostics = self.mine(step, index, queries, cancel, marks=marks)
        mine_s = time.monotonic() - started
        marks["mined_at"] = time.time()

        ctx.state.update(phase=f"evaluating {step}")
        started = time.monotonic()
        intervals: dict[str, dict[str, list[float]]] = {}
        metrics = self.evaluate(index, queries, cancel, marks=marks, intervals=intervals)
        eval_s = time.monotonic() - started
        marks["evaluated_at"] = time.time()
        timings = {"build_s": build_s, "mine_s": mine_s, "eval_s": eval_s,
                   "shards_added_early": float(early)}
        # The index serves searches from now on; then the events go out.
        self.search.serve(ServedIndex(step, index))
        self._announce(step, table, dual, diagnostics, metrics, timings, marks, intervals)

    def build_part(self, step: int) -> None:
        """P > 1: build this partition's index of ``step``, search every query, store the
        top-K lists and announce them (``partition.searched``)."""
        ctx = self.ctx
        cancel = lambda: self._check_superseded(step)  # noqa: E731
        started = time.monotonic()
        ctx.state.update(state="running", phase=f"building index {step}", checkpoint_step=step)
        plan = self.plans[step]
        index, queries, early = self._index(step, cancel)
        build_s = time.monotonic() - started
        ctx.state.update(phase=f"searching {step}")
        started = time.monotonic()
        groups = self.search_groups(index, queries, cancel)
        positives = self.positive_docs[
            plan.shard_of_doc(self.positive_docs) % self.partitions == self.partition]
        key = keys.partial_results(step, self.partition, self.partitions)
        if isinstance(index, PassageIndex):  # every passage of the positives
            positives = index.keys_of(positives)
            vectors = index.rows.vectors(positives)
        else:
            vectors = index.vectors(positives)
        ctx.store.put_bytes(key, pack_partials(groups, positives, vectors))
        search_s = time.monotonic() - started
        self.search.serve(ServedIndex(step, index))
        self.last_searched = step
        ctx.bus.publish(PartitionSearched(step=step, partition=self.partition,
                                          partitions=self.partitions, key=key,
                                          documents=len(index), build_s=build_s,
                                          search_s=search_s, shards_added_early=early))
        ctx.state.update(state="idle", phase="waiting for shards", index_step=step)
        ctx.log.info("checkpoint %d: partition %d of %d searched (%d documents, %d of %d "
                     "shards added while encoding, then build %.1fs, search %.1fs)", step,
                     self.partition, self.partitions, len(index), early,
                     len(plan.owned_shards(self.partition, self.partitions)), build_s,
                     search_s)
        if not self.coordinator:  # partition 0 keeps its plans until it merged them
            for old in [s for s in self.plans if s <= step]:
                self._forget(old)

    def search_groups(self, index: AnnIndex | PassageIndex, queries: QueryVectors,
                      cancel: Callable[[], None]) -> dict[str, TopK]:
        """The top-K lists a refresh needs: the training queries at the mining depth, each
        evaluated split's queries at ``index.eval_depth`` (the searches one index runs in
        :meth:`mine` and :meth:`evaluate`, query for query and batch for batch)."""
        cfg, batch = self.ctx.config, self.ctx.config.index.search_batch_size
        groups = {"train": TopK(np.array(self.train_ids),
                                *index.search(queries.of(self.train_ids), self.train_depth(),
                                              batch, cancel))}
        for split in cfg.index.eval_splits:
            qids = sorted(getattr(self.ctx.dataset, split))
            if qids:
                groups[split] = TopK(np.array(qids), *index.search(
                    queries.of(qids), cfg.index.eval_depth, batch, cancel))
        return groups

    def merge(self, step: int) -> None:
        """Partition 0, once every partition's lists of ``step`` are stored: merge them into
        the global top-K, mine, evaluate and announce the refresh (once: the announcement is
        what :meth:`recover` reads back, and a merge redone after a restart rewrites the
        same objects)."""
        ctx, cfg = self.ctx, self.ctx.config
        cancel = lambda: self._check_superseded(step, merging=True)  # noqa: E731
        started = time.monotonic()
        # The partitions built and searched; here "index build" is reading their lists and
        # "search" is empty (their build_s / search_s are in the timings).
        marks: dict[str, float] = {"build_started_at": time.time()}
        ctx.state.update(state="running", phase=f"merging {step}", checkpoint_step=step)
        plan = self.plans[step]
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
            depth = self.train_depth() if name == "train" else cfg.index.eval_depth
            merged[name] = TopK(first.query_ids, *merge_topk(
                [(part.groups[name].ids, part.groups[name].scores) for part in parts], depth))
        queries = self._load_queries(step, plan)
        dim = queries.vectors.shape[1]
        known = (np.concatenate([part.doc_ids for part in parts]),
                 np.concatenate([part.doc_vectors.reshape(-1, dim) for part in parts]))
        merged_rows = MergedIndex(ctx.store, plan, dim, known=known,
                                  max_passages=self.max_passages)
        view = (merged_rows if self.max_passages is None
                else PassageIndex(merged_rows, self.max_passages, plan.num_docs))
        merge_s = time.monotonic() - started
        marks["built_at"] = marks["searched_at"] = time.time()

        ctx.state.update(phase=f"mining {step}")
        started = time.monotonic()
        table, dual, diagnostics = self.mine(step, view, queries, cancel, merged["train"])
        mine_s = time.monotonic() - started
        marks["mined_at"] = time.time()

        ctx.state.update(phase=f"evaluating {step}")
        started = time.monotonic()
        intervals: dict[str, dict[str, list[float]]] = {}
        metrics = self.evaluate(view, queries, cancel, merged, intervals=intervals)
        eval_s = time.monotonic() - started
        marks["evaluated_at"] = time.time()
        events = self.searched[step].values()
        timings = {"build_s": max(e.build_s for e in events),
                   "search_s": max(e.search_s for e in events),
                   "shards_added_early": float(sum(e.shards_added_early for e in events)),
                   "merge_s": merge_s, "mine_s": mine_s, "eval_s": eval_s}
        ctx.log.info("checkpoint %d: merged %d partitions' lists (%d corpus shards read back "
                     "for vectors)", step, self.partitions, merged_rows.shards_read)
        self._announce(step, table, dual, diagnostics, metrics, timings, marks, intervals)
        for old in [s for s in self.searched if s <= step]:
            self.searched.pop(old, None)

    def _announce(self, step: int, table: NegativesTable | None, dual: NegativesTable | None,
                  diagnostics: dict, metrics: dict, timings: dict, marks: dict,
                  intervals: dict | None = None) -> None:
        """Store the evaluation report, then publish ``negatives.ready`` and
        ``eval.completed`` of ``step`` (the tables are stored already). ``marks``: the
        indexer's times of the refresh timeline; ``intervals``: split → measure → the
        bootstrap 95% interval (the report's ``ci95``, :func:`~ance_train.evaluation.
        bootstrap_ci`)."""
        ctx = self.ctx
        times = IndexerTimes(complete_at=self.completed_wall.get(step),
                             announced_at=time.time(), **marks)
        timeline = self._timeline(step, times)
        ctx.store.put_json(keys.eval_report(step), {"step": step, "metrics": metrics,
                                                    "timings": timings,
                                                    "ci95": intervals or {},
                                                    "diagnostics": diagnostics,
                                                    "times": times.model_dump(),
                                                    "timeline": timeline})
        self.last_built = step
        if table is not None:
            self.previous = table
        ready_id = None
        tables = tuple(t for t, mined in ((TableId.ann(step), table), (TableId.dual(step), dual))
                       if mined is not None)
        if tables:
            ready_id = ctx.bus.publish(NegativesReady(tables=tables))
        eval_id = ctx.bus.publish(EvalCompleted(step=step, key=keys.eval_report(step),
                                                metrics=metrics, timings=timings,
                                                diagnostics=diagnostics, times=times))
        refresh_s = self._refresh_seconds(step, ready_id or eval_id)
        self.telemetry.refreshed(step, refresh_s, metrics)
        self._track(step, refresh_s, self._tail_seconds(step, ready_id or eval_id), timings,
                    metrics, diagnostics, timeline)
        flat = {f"{split}/{name}": value for split, values in metrics.items()
                for name, value in values.items()}
        ctx.state.update(state="idle", phase="waiting for shards", index_step=step, metrics=flat)
        ctx.log.info("checkpoint %d indexed: %s", step, json.dumps(metrics))
        for split, values in metrics.items():  # the noise of each split's nDCG@10
            if CI_MEASURE in values:
                ctx.log.info("checkpoint %d %s %s %s (bootstrap 95%%, %d queries)", step,
                             split, CI_MEASURE,
                             format_interval(values[CI_MEASURE],
                                             (intervals or {}).get(split, {}).get(CI_MEASURE)),
                             len(getattr(ctx.dataset, split)))
        for old in [s for s in {*self.plans, *self.shard_events} if s <= step]:
            self._forget(old)
        self.retain()

    def _forget(self, step: int) -> None:
        """Drop what was kept about checkpoint ``step`` while it was pending."""
        for table in (self.plans, self.received, self.published_at, self.completed_at,
                      self.published, self.shard_events, self.completed_wall):
            table.pop(step, None)

    def retain(self) -> None:
        """After a refresh: delete superseded refreshes' objects, list the run's size."""
        try:
            self.retention.sweep_refreshes()
            self.ctx.state.update(store_bytes=self.ctx.store.usage())
        except (*REDIS_UNAVAILABLE, StorageError) as error:  # retried after the next refresh
            self.ctx.log.warning("refresh retention / store size failed: %s", error)

    def _timeline(self, step: int, times: IndexerTimes) -> dict | None:
        """The refresh's timeline up to negatives.ready (None, logged, when a part of it was
        not recorded: shards from before a restart whose events were trimmed, an older
        trainer or replica)."""
        published = self.published.get(step)
        if published is None:
            return None
        try:
            return refresh_timeline(published, self.shard_events.get(step, {}).values(), times)
        except ValueError as error:
            self.ctx.log.info("no refresh timeline: %s", error)
            return None

    def _track(self, step: int, refresh_s: float | None, tail_s: float | None, timings: dict,
               metrics: dict, diagnostics: dict, timeline: dict | None = None) -> None:
        """The refresh's scalars at global step = its checkpoint step: the refresh period
        (checkpoint published → negatives ready), the tail after its last shard, their
        parts, the timeline's rows, the metrics per split and the diagnostics (overlap,
        forgetting rate, composition)."""
        scalars = flatten(timings, "refresh/")
        if timeline is not None:
            scalars.update(timeline_scalars(timeline))
        if refresh_s is not None:
            scalars["refresh/period_s"] = refresh_s
        if tail_s is not None:
            scalars["refresh/tail_s"] = tail_s
        scalars.update(flatten(metrics, "eval/"))
        scalars.update(flatten({k: v for k, v in diagnostics.items()
                                if k != "overlap_source_step"}, "diagnostics/"))
        self.tracking.scalars(step, scalars)
        self.tracking.flush()

    def _refresh_seconds(self, step: int, done_entry_id: str) -> float | None:
        """Checkpoint published → its negatives ready, both by the Redis server's clock."""
        published = self.published_at.get(step)
        return None if published is None else entry_seconds(done_entry_id) - published

    def _tail_seconds(self, step: int, done_entry_id: str) -> float | None:
        """The checkpoint's last shard encoded → its negatives ready (Redis server's clock;
        None when the shards were already in the store at start-up)."""
        completed = self.completed_at.get(step)
        return None if completed is None else entry_seconds(done_entry_id) - completed

    def _load_queries(self, step: int, plan: RefreshPlan) -> QueryVectors:
        """Every encoded query's vector, by query id (the shards carry the ids)."""
        parts = [self._load_shard(step, ShardKind.QUERIES, shard)
                 for shard in range(len(plan.query_ranges))]
        return QueryVectors(np.concatenate([ids for ids, _ in parts]),
                            np.concatenate([vectors for _, vectors in parts]))

    def _load_shard(self, step: int, kind: ShardKind, shard: int
                    ) -> tuple[np.ndarray, np.ndarray]:
        """A shard's ids and vectors. One that fails its checksum is never used: it is deleted
        and queued again, and the checkpoint is complete again once it is re-encoded."""
        work = self.plans[step].work(kind)[shard]
        try:
            data = self.ctx.store.get_bytes(work.key)
            if kind is ShardKind.CORPUS:  # documents, or MaxP passages
                return unpack_rows(data, self.max_passages)
            return unpack_embeddings(data)
        except CorruptObject as error:
            self.ctx.log.error("%s; deleting it and queuing %s@%d again", error, work.name, step)
            self.received[step].discard(work.key)
            self.ctx.store.delete(work.key)
            self.work_queue.enqueue([work])
            raise ShardRequeued(work.key) from error

    def train_depth(self) -> int:
        """How deep the training queries are searched: the mining's candidates plus room for
        the positives removed (and at least the diagnostics' top 100)."""
        return max(100, self.miner.depth()) + self.miner.max_positives

    def mine(self, step: int, index: AnnIndex | MergedIndex | PassageIndex, queries: QueryVectors,
             cancel: Callable[[], None], searched: TopK | None = None,
             marks: dict[str, float] | None = None
             ) -> tuple[NegativesTable | None, NegativesTable | None, dict]:
        """The refresh's negatives (the pool's, if it mines ANN), DANCE's negative queries
        (when enabled) and the diagnostics. ``searched``: the training queries' merged lists
        (partitions); without it ``index`` is searched here (``marks["searched_at"]``:
        when that search ended)."""
        ctx, cfg = self.ctx, self.ctx.config
        train_queries = queries.of(self.train_ids)
        if searched is None:
            ranked, sims = index.search(train_queries, self.train_depth(),
                                        cfg.index.search_batch_size, cancel)
        else:
            if list(searched.query_ids) != self.train_ids:
                raise ValueError("merged training lists are not in training-query order")
            ranked, sims = searched.ids, searched.scores
        if marks is not None:
            marks["searched_at"] = time.time()
        table = dual = None
        if self.miner.pool.mines_ann:
            table = self.miner.mine(step, index, train_queries, ranked, sims, self.previous,
                                    cancel, cfg.index.search_batch_size)
            store_table(ctx.store, TableId.ann(step).key, table, ctx.work_dir)
        if self.dance.enabled:
            # The cast: DANCE with MaxP is rejected by the configuration (_check_passages), so
            # the index holds one vector per document here (an AnnIndex or a MergedIndex).
            dual = self.dance.mine(step, ctx.dataset, self.train_ids,
                                   cast("VectorIndex", index), train_queries)
            store_table(ctx.store, TableId.dual(step).key, dual, ctx.work_dir)
        diagnostics = self.diagnostics.compute(ranked, self.previous, table)
        return table, dual, diagnostics

    def evaluate(self, index: AnnIndex | MergedIndex | PassageIndex, queries: QueryVectors,
                 cancel: Callable[[], None], searched: dict[str, TopK] | None = None,
                 marks: dict[str, float] | None = None,
                 intervals: dict[str, dict[str, list[float]]] | None = None) -> dict:
        """Metrics per evaluated split; ``searched``: the merged lists per split
        (partitions), else ``index`` is searched here (``marks["eval_search_s"]``: the
        seconds those searches took; ``intervals[split][CI_MEASURE]``: its bootstrap 95%
        interval)."""
        cfg, dataset = self.ctx.config, self.ctx.dataset
        results = {}
        search_s = 0.0
        for split in cfg.index.eval_splits:
            qrels = getattr(dataset, split)
            if not qrels:
                continue
            qids = sorted(qrels)
            if searched is None:
                started = time.monotonic()
                ranked, scores = index.search(queries.of(qids), cfg.index.eval_depth,
                                              cfg.index.search_batch_size, cancel)
                search_s += time.monotonic() - started
            else:
                if list(searched[split].query_ids) != qids:
                    raise ValueError(f"merged {split} lists are not of the {split} queries")
                ranked, scores = searched[split].ids, searched[split].scores
            run = {q: {str(d): float(s) for d, s in zip(r, sc, strict=True) if d >= 0}
                   for q, r, sc in zip(qids, ranked, scores, strict=True)}
            str_qrels = {q: {str(d): rel for d, rel in rels.items()} for q, rels in qrels.items()}
            results[split], interval = evaluate_with_interval(run, str_qrels)
            if intervals is not None and interval is not None:
                intervals[split] = {CI_MEASURE: list(interval)}
        if marks is not None:
            marks["eval_search_s"] = search_s
        return results


def serve(ctx: ServiceContext) -> int:
    indexer = Indexer(ctx)
    limits = ctx.config.index.search
    return ctx.serve(indexer.run, indexer.search.add_to_server,
                     max_message_bytes=limits.max_message_bytes,
                     max_concurrent_rpcs=limits.max_concurrent_rpcs)
