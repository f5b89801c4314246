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
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import numpy as np
import torch

from ance_train.evaluation import evaluate
from ance_train.index.ann import AnnIndex, use_gpu
from ance_train.indexer.diagnostics import Diagnostics
from ance_train.indexer.search_service import SearchService, ServedIndex
from ance_train.infra.bus import REDIS_UNAVAILABLE, Received, WorkQueue, entry_seconds
from ance_train.infra.store import CorruptObject, StorageError
from ance_train.modeling.checkpoint_cache import ModelCache
from ance_train.negatives.mining import Miner, positives_of
from ance_train.negatives.strategies.bm25 import bm25_negatives
from ance_train.negatives.table import NegativesTable, store_table
from ance_train.observability.telemetry import IndexerTelemetry
from ance_train.observability.tracking import flatten, open_tracking
from ance_train.protocol import keys
from ance_train.protocol.embeddings import unpack_embeddings
from ance_train.protocol.events import (
    CheckpointPublished,
    EvalCompleted,
    NegativesReady,
    ShardEncoded,
    ShardFailed,
)
from ance_train.protocol.supersession import Superseded, next_to_build, superseded
from ance_train.protocol.tables import TableId, TableKind
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


class Indexer:
    GROUP = "indexer"

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.plans: dict[int, RefreshPlan] = {}  # published, not yet built or abandoned
        self.received: dict[int, set[str]] = {}
        self.published_at: dict[int, float] = {}  # Redis server time of checkpoint.published
        self.last_built: int | None = None
        self.abandoned: set[int] = set()  # checkpoints with a shard.failed item
        self.train_ids = sorted(ctx.dataset.train)
        cfg = ctx.config
        self.miner = Miner(cfg.negatives, cfg.model.temperature, ctx.dataset, self.train_ids,
                           cfg.training.seed)
        self.dance = cfg.negatives.strategy("dance")  # DANCE's negative queries (when on)
        self.diagnostics = Diagnostics(self.train_ids, positives_of(ctx.dataset, self.train_ids),
                                       cfg.training.seed)
        self.previous: NegativesTable | None = None
        use_gpu(cfg.index.device)  # index.device gpu without a FAISS GPU fails at start
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.models = ModelCache(ctx.store, ctx.config.model, ctx.work_dir / "checkpoints", device)
        self.search = SearchService(ctx.corpus, self.models, ctx.config.model.max_query_length)
        self._last_poll = 0.0
        self.telemetry = IndexerTelemetry(ctx.reporter)
        self.tracking = open_tracking(cfg, "indexer", ctx.store, ctx.work_dir)
        self.work_queue = WorkQueue(ctx.bus, ctx.config.inference.claim_timeout_s)

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
        if table is not None:
            self.previous = NegativesTable.from_bytes(self.ctx.store.get_bytes(table.key))
        for received in bus.history(CheckpointPublished):
            self._add_plan(received)
        for failed in bus.history(ShardFailed):
            self._abandon(failed.event)
        self.ctx.log.info("recovered: last built checkpoint %s, pending %s",
                          "none" if self.last_built is None else self.last_built,
                          sorted(self.plans))

    def _built(self, step: int) -> bool:
        return self.last_built is not None and step <= self.last_built

    def _add_plan(self, received: Received[CheckpointPublished]) -> None:
        step = received.event.step
        if step in self.plans or self._built(step) or step in self.abandoned:
            return  # a duplicate or stale event
        self.published_at[step] = entry_seconds(received.entry_id)
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
        for table in (self.plans, self.received, self.published_at):
            table.pop(step, None)
        self.ctx.log.error("checkpoint %d abandoned: %s was given up after %s attempts: %s",
                           step, event.key, event.attempt, event.error)

    def poll(self, block_ms: int) -> None:
        bus = self.ctx.bus
        for published in bus.consume(CheckpointPublished, self.GROUP, "indexer", block_ms=0):
            self._add_plan(published)
            bus.ack(CheckpointPublished, self.GROUP, published.entry_id)
        for failed in bus.consume(ShardFailed, self.GROUP, "indexer", block_ms=0):
            self._abandon(failed.event)
            bus.ack(ShardFailed, self.GROUP, failed.entry_id)
        for encoded in bus.consume(ShardEncoded, self.GROUP, "indexer", block_ms=block_ms,
                                   count=256):
            if not self._built(encoded.event.step):
                self.received.setdefault(encoded.event.step, set()).add(encoded.event.key)
            bus.ack(ShardEncoded, self.GROUP, encoded.entry_id)
        self._last_poll = time.monotonic()

    def newest_complete(self) -> int | None:
        """The checkpoint to build next (see :mod:`ance_train.protocol.supersession`)."""
        complete = {step: plan.expected_keys() <= self.received.get(step, set())
                    for step, plan in self.plans.items()}
        return next_to_build(complete, self.last_built)

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
        while not ctx.stop.is_set():
            try:
                self.poll(block_ms=500)
            except REDIS_UNAVAILABLE as error:  # back off; the groups keep our place
                ctx.log.warning("reading events failed: %s", error)
                ctx.stop.wait(1.0)
                continue
            step = self.newest_complete()
            if step is None:
                continue
            try:
                self.process(step)
            except Superseded:
                ctx.log.info("checkpoint %d superseded while indexing", step)
            except ShardRequeued as error:
                ctx.log.warning("checkpoint %d waits for %s to be encoded again", step, error)
            except (*REDIS_UNAVAILABLE, StorageError) as error:
                ctx.log.warning("indexing checkpoint %d failed, will retry: %s", step, error)
                ctx.stop.wait(1.0)

    def _check_superseded(self, step: int) -> None:
        """Called between batches of a build: raises :class:`Superseded` if a newer
        checkpoint completed meanwhile (or the service is stopping)."""
        if time.monotonic() - self._last_poll > 1.0:
            self.poll(block_ms=0)
        if self.ctx.stop.is_set() or superseded(step, self.newest_complete()):
            raise Superseded(step)

    def publish_bm25_negatives(self) -> None:
        ctx = self.ctx
        table_id = TableId.bm25()
        key = table_id.key
        if not ctx.store.exists(key):
            ctx.state.update(state="running", phase="BM25 negatives")
            started = time.monotonic()
            table = bm25_negatives(ctx.corpus, ctx.dataset, self.train_ids,
                                   ctx.config.negatives.bm25.top_k)
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
        ctx.state.update(state="running", phase=f"building index {step}", checkpoint_step=step)
        plan = self.plans[step]
        index: AnnIndex | None = None
        for shard in range(len(plan.corpus_ranges)):
            cancel()
            ids, vectors = self._load_shard(step, ShardKind.CORPUS, shard)
            if index is None:
                # Inner product over the model's embeddings as they are: a cosine BiEncoder
                # already returns unit vectors (normalised once, in the model).
                index = AnnIndex(vectors.shape[1], ctx.config.index,
                                 expected_size=plan.num_docs)
            index.add(ids, vectors)
        assert index is not None
        index.finalize()
        queries = self._load_queries(step, plan)
        build_s = time.monotonic() - started

        ctx.state.update(phase=f"mining {step}")
        started = time.monotonic()
        table, dual, diagnostics = self.mine(step, index, queries, cancel)
        mine_s = time.monotonic() - started

        ctx.state.update(phase=f"evaluating {step}")
        started = time.monotonic()
        metrics = self.evaluate(index, queries, cancel)
        eval_s = time.monotonic() - started
        timings = {"build_s": build_s, "mine_s": mine_s, "eval_s": eval_s}
        ctx.store.put_json(keys.eval_report(step), {"step": step, "metrics": metrics,
                                                    "timings": timings,
                                                    "diagnostics": diagnostics})
        # The index serves searches from now on; then the events go out.
        self.search.serve(ServedIndex(step, index))
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
                                                diagnostics=diagnostics))
        refresh_s = self._refresh_seconds(step, ready_id or eval_id)
        self.telemetry.refreshed(step, refresh_s, metrics)
        self._track(step, refresh_s, timings, metrics, diagnostics)
        flat = {f"{split}/{name}": value for split, values in metrics.items()
                for name, value in values.items()}
        ctx.state.update(state="idle", phase="waiting for shards", index_step=step, metrics=flat)
        ctx.log.info("checkpoint %d indexed: %s", step, json.dumps(metrics))
        for old in [s for s in self.plans if s <= step]:
            self.plans.pop(old, None)
            self.received.pop(old, None)
            self.published_at.pop(old, None)

    def _track(self, step: int, refresh_s: float | None, timings: dict, metrics: dict,
               diagnostics: dict) -> None:
        """The refresh's scalars at global step = its checkpoint step: the refresh period
        (checkpoint published → negatives ready) and its parts, the metrics per split and
        the diagnostics (overlap, forgetting rate, composition)."""
        scalars = flatten(timings, "refresh/")
        if refresh_s is not None:
            scalars["refresh/period_s"] = refresh_s
        scalars.update(flatten(metrics, "eval/"))
        scalars.update(flatten({k: v for k, v in diagnostics.items()
                                if k != "overlap_source_step"}, "diagnostics/"))
        self.tracking.scalars(step, scalars)
        self.tracking.flush()

    def _refresh_seconds(self, step: int, done_entry_id: str) -> float | None:
        """Checkpoint published → its negatives ready, both by the Redis server's clock."""
        published = self.published_at.get(step)
        return None if published is None else entry_seconds(done_entry_id) - published

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
            return unpack_embeddings(self.ctx.store.get_bytes(work.key))
        except CorruptObject as error:
            self.ctx.log.error("%s; deleting it and queuing %s@%d again", error, work.name, step)
            self.received[step].discard(work.key)
            self.ctx.store.delete(work.key)
            self.work_queue.enqueue([work])
            raise ShardRequeued(work.key) from error

    def mine(self, step: int, index: AnnIndex, queries: QueryVectors, cancel: Callable[[], None]
             ) -> tuple[NegativesTable | None, NegativesTable | None, dict]:
        """The refresh's negatives (the pool's, if it mines ANN), DANCE's negative queries
        (when enabled) and the diagnostics."""
        ctx, cfg = self.ctx, self.ctx.config
        train_queries = queries.of(self.train_ids)
        depth = max(100, self.miner.depth()) + self.miner.max_positives
        ranked, sims = index.search(train_queries, depth, cfg.index.search_batch_size, cancel)
        table = dual = None
        if self.miner.pool.mines_ann:
            table = self.miner.mine(step, index, train_queries, ranked, sims, self.previous,
                                    cancel, cfg.index.search_batch_size)
            store_table(ctx.store, TableId.ann(step).key, table, ctx.work_dir)
        if self.dance.enabled:
            dual = self.dance.mine(step, ctx.dataset, self.train_ids, index, train_queries)
            store_table(ctx.store, TableId.dual(step).key, dual, ctx.work_dir)
        diagnostics = self.diagnostics.compute(ranked, self.previous, table)
        return table, dual, diagnostics

    def evaluate(self, index: AnnIndex, queries: QueryVectors, cancel: Callable[[], None]
                 ) -> dict:
        cfg, dataset = self.ctx.config, self.ctx.dataset
        results = {}
        for split in cfg.index.eval_splits:
            qrels = getattr(dataset, split)
            if not qrels:
                continue
            qids = sorted(qrels)
            ranked, scores = index.search(queries.of(qids), cfg.index.eval_depth,
                                          cfg.index.search_batch_size, cancel)
            run = {q: {str(d): float(s) for d, s in zip(r, sc, strict=True) if d >= 0}
                   for q, r, sc in zip(qids, ranked, scores, strict=True)}
            str_qrels = {q: {str(d): rel for d, rel in rels.items()} for q, rels in qrels.items()}
            results[split] = evaluate(run, str_qrels)
        return results


def serve(ctx: ServiceContext) -> int:
    indexer = Indexer(ctx)
    return ctx.serve(indexer.run, indexer.search.add_to_server)
