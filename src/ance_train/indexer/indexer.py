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

import numpy as np
import torch

from ance_train.evaluation import evaluate
from ance_train.index.ann import AnnIndex, Superseded, use_gpu
from ance_train.indexer.diagnostics import Diagnostics
from ance_train.indexer.search_service import SearchService, ServedIndex
from ance_train.infra import bus as events
from ance_train.infra.store import CorruptObject, StorageError
from ance_train.modeling.checkpoint_cache import ModelCache
from ance_train.negatives.mining import Miner, positives_of
from ance_train.negatives.strategies.bm25 import bm25_negatives
from ance_train.negatives.table import NegativesTable
from ance_train.observability.telemetry import IndexerTelemetry
from ance_train.protocol.refresh import (
    CORPUS,
    QUERIES,
    ZERO_SHOT_STEP,
    RefreshPlan,
    embedding_key,
    eval_key,
    negatives_key,
    query_order,
    unpack_embeddings,
)
from ance_train.runtime import ServiceContext

BM25_STEP = -1


class ShardRequeued(Exception):
    """A shard failed its checksum: it was deleted and queued to be encoded again."""


class Indexer:
    GROUP = "indexer"

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.plans: dict[int, RefreshPlan] = {}
        self.received: dict[int, set[str]] = {}
        self.published_at: dict[int, float] = {}  # Redis server time of checkpoint.published
        self.last_built = -1
        self.abandoned: set[int] = set()  # checkpoints with a shard.failed item
        self.query_ids = query_order(ctx.dataset)
        self.query_row = {q: i for i, q in enumerate(self.query_ids)}
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
        self.work_queue = events.WorkQueue(ctx.bus, ctx.config.inference.claim_timeout_s)

    # -- event handling ---------------------------------------------------------------------
    def recover(self) -> None:
        """Rebuild state from the streams' history and the store (restart-safe).

        The newest checkpoint whose ``negatives.ready`` or ``eval.completed`` went out is the
        last one built; every later published checkpoint is planned again with the shards
        already stored, so one interrupted mid-build is rebuilt from the start (outputs it
        had half-written are overwritten before any event announces them).
        """
        bus = self.ctx.bus
        done = [e for e in bus.history(events.NEGATIVES_READY) if e.step >= 0]
        evaluated = [e.step for e in bus.history(events.EVAL_COMPLETED)]
        self.last_built = max([e.step for e in done] + evaluated, default=-1)
        latest = max(done, key=lambda e: e.step, default=None)
        if latest is not None and latest.payload.get("key"):
            self.previous = NegativesTable.from_bytes(self.ctx.store.get_bytes(
                latest.payload["key"]))
        for event in bus.history(events.CHECKPOINT_PUBLISHED):
            self._add_plan(event)
        for event in bus.history(events.SHARD_FAILED):
            self._abandon(event)
        self.ctx.log.info("recovered: last built checkpoint %d, pending %s", self.last_built,
                          sorted(self.plans))

    def _add_plan(self, event: events.Event) -> None:
        step = event.step
        if step in self.plans or step <= self.last_built or step in self.abandoned:
            return  # a duplicate or stale event
        self.published_at[step] = events.entry_seconds(event.entry_id)
        self.plans[step] = RefreshPlan.from_payload(step, event.payload)
        # Shards already in the store count (an indexer restarted mid-refresh loses nothing).
        self.received[step] = set(self.ctx.store.list(f"embeddings/{step}"))

    def _abandon(self, event: events.Event) -> None:
        """Drop the plan of a checkpoint that can never be complete (see ``shard.failed``)."""
        step = event.step
        plan = self.plans.get(step)
        if step <= self.last_built or step in self.abandoned or (
                plan is not None and plan.expected_keys() <= self.received.get(step, set())):
            return  # built, already abandoned, or complete after all (another replica's copy)
        self.abandoned.add(step)
        for table in (self.plans, self.received, self.published_at):
            table.pop(step, None)
        self.ctx.log.error("checkpoint %d abandoned: %s was given up after %s attempts: %s",
                           step, event.payload.get("key"), event.payload.get("attempt"),
                           event.payload.get("error"))

    def poll(self, block_ms: int) -> None:
        bus = self.ctx.bus
        for event in bus.consume(events.CHECKPOINT_PUBLISHED, self.GROUP, "indexer", block_ms=0):
            self._add_plan(event)
            bus.ack(events.CHECKPOINT_PUBLISHED, self.GROUP, event.entry_id)
        for event in bus.consume(events.SHARD_FAILED, self.GROUP, "indexer", block_ms=0):
            self._abandon(event)
            bus.ack(events.SHARD_FAILED, self.GROUP, event.entry_id)
        for event in bus.consume(events.SHARD_ENCODED, self.GROUP, "indexer", block_ms=block_ms,
                                 count=256):
            if event.step > self.last_built:
                self.received.setdefault(event.step, set()).add(event.payload["key"])
            bus.ack(events.SHARD_ENCODED, self.GROUP, event.entry_id)
        self._last_poll = time.monotonic()

    def newest_complete(self) -> int | None:
        """The checkpoint to build next: checkpoint 0 first, then the newest complete one."""
        if ZERO_SHOT_STEP in self.plans and self.last_built < ZERO_SHOT_STEP:
            zero_shot = self.plans[ZERO_SHOT_STEP]
            done = zero_shot.expected_keys() <= self.received.get(ZERO_SHOT_STEP, set())
            return ZERO_SHOT_STEP if done else None
        complete = [step for step, plan in self.plans.items()
                    if step > self.last_built
                    and plan.expected_keys() <= self.received.get(step, set())]
        return max(complete, default=None)

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        ctx = self.ctx
        self.recover()
        if ctx.config.negatives.uses_bm25:
            self.publish_bm25_negatives()
        ctx.state.update(state="idle", phase="waiting for shards", index_step=self.last_built)
        while not ctx.stop.is_set():
            try:
                self.poll(block_ms=500)
            except Exception as error:  # Redis restarting: back off, groups keep our place
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
            except (*events.REDIS_UNAVAILABLE, StorageError) as error:
                ctx.log.warning("indexing checkpoint %d failed, will retry: %s", step, error)
                ctx.stop.wait(1.0)

    def _superseded(self, step: int) -> bool:
        if time.monotonic() - self._last_poll > 1.0:
            self.poll(block_ms=0)
        if self.ctx.stop.is_set():
            return True
        newest = self.newest_complete()
        return step != ZERO_SHOT_STEP and newest is not None and newest > step

    def publish_bm25_negatives(self) -> None:
        ctx = self.ctx
        key = negatives_key("bm25")
        if not ctx.store.exists(key):
            ctx.state.update(state="running", phase="BM25 negatives")
            started = time.monotonic()
            table = bm25_negatives(ctx.corpus, ctx.dataset, self.train_ids,
                                   ctx.config.negatives.bm25.top_k)
            ctx.store.put_bytes(key, table.to_bytes())
            if self.previous is None:  # what the trainer uses until the first ANN refresh
                self.previous = table
            ctx.log.info("BM25 negatives for %d queries in %.1fs", len(table),
                         time.monotonic() - started)
        elif self.previous is None:  # restarted before the first ANN refresh
            self.previous = NegativesTable.from_bytes(ctx.store.get_bytes(key))
        ctx.bus.publish(events.NEGATIVES_READY, BM25_STEP, key=key, source="bm25")

    def process(self, step: int) -> None:
        ctx = self.ctx
        should_stop = lambda: self._superseded(step)  # noqa: E731
        started = time.monotonic()
        ctx.state.update(state="running", phase=f"building index {step}", checkpoint_step=step)
        plan = self.plans[step]
        index: AnnIndex | None = None
        for shard in range(len(plan.corpus_ranges)):
            if should_stop():
                raise Superseded()
            ids, vectors = self._load_shard(step, CORPUS, shard)
            if index is None:
                index = AnnIndex(vectors.shape[1], ctx.config.index, ctx.config.model.similarity,
                                 expected_size=plan.corpus_ranges[-1][1])
            index.add(ids, vectors)
        assert index is not None
        index.finalize()
        queries = self._load_queries(step, plan, index.dim)
        build_s = time.monotonic() - started

        ctx.state.update(phase=f"mining {step}")
        started = time.monotonic()
        table, dual, diagnostics = self.mine(step, index, queries, should_stop)
        mine_s = time.monotonic() - started

        ctx.state.update(phase=f"evaluating {step}")
        started = time.monotonic()
        metrics = self.evaluate(index, queries, should_stop)
        eval_s = time.monotonic() - started
        timings = {"build_s": build_s, "mine_s": mine_s, "eval_s": eval_s}
        ctx.store.put_json(eval_key(step), {"step": step, "metrics": metrics,
                                            "timings": timings, "diagnostics": diagnostics})
        # The index serves searches from now on; then the events go out.
        self.search.serve(ServedIndex(step, index))
        self.last_built = step
        if table is not None:
            self.previous = table
        ready_id = None
        if table is not None or dual is not None:
            ready_id = ctx.bus.publish(
                events.NEGATIVES_READY, step, source="ann",
                key=negatives_key(step) if table is not None else None,
                dual_key=negatives_key(f"{step}-dual") if dual is not None else None)
        eval_id = ctx.bus.publish(events.EVAL_COMPLETED, step, key=eval_key(step),
                                  metrics=metrics, timings=timings, diagnostics=diagnostics)
        self.telemetry.refreshed(step, self._refresh_seconds(step, ready_id or eval_id), metrics)
        flat = {f"{split}/{name}": value for split, values in metrics.items()
                for name, value in values.items()}
        ctx.state.update(state="idle", phase="waiting for shards", index_step=step, metrics=flat)
        ctx.log.info("checkpoint %d indexed: %s", step, json.dumps(metrics))
        for old in [s for s in self.plans if s <= step]:
            self.plans.pop(old, None)
            self.received.pop(old, None)
            self.published_at.pop(old, None)

    def _refresh_seconds(self, step: int, done_entry_id: str) -> float | None:
        """Checkpoint published → its negatives ready, both by the Redis server's clock."""
        published = self.published_at.get(step)
        return None if published is None else events.entry_seconds(done_entry_id) - published

    def _load_queries(self, step: int, plan: RefreshPlan, dim: int) -> np.ndarray:
        matrix = np.zeros((len(self.query_ids), dim), dtype=np.float32)
        for shard in range(len(plan.query_ranges)):
            ids, vectors = self._load_shard(step, QUERIES, shard)
            matrix[ids] = vectors
        return matrix

    def _load_shard(self, step: int, kind: str, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """A shard's ids and vectors. One that fails its checksum is never used: it is deleted
        and queued again, and the checkpoint is complete again once it is re-encoded."""
        key = embedding_key(step, kind, shard)
        try:
            return unpack_embeddings(self.ctx.store.get_bytes(key))
        except CorruptObject as error:
            self.ctx.log.error("%s; deleting it and queuing %s-%05d@%d again", error, kind,
                               shard, step)
            plan = self.plans[step]
            ranges = plan.corpus_ranges if kind == CORPUS else plan.query_ranges
            self.received[step].discard(key)
            self.ctx.store.delete(key)
            self.work_queue.enqueue(step, kind, [ranges[shard]], first_shard=shard)
            raise ShardRequeued(key) from error

    def mine(self, step: int, index: AnnIndex, queries: np.ndarray, should_stop
             ) -> tuple[NegativesTable | None, NegativesTable | None, dict]:
        """The refresh's negatives (the pool's, if it mines ANN), DANCE's negative queries
        (when enabled) and the diagnostics."""
        ctx, cfg = self.ctx, self.ctx.config
        train_queries = queries[np.array([self.query_row[q] for q in self.train_ids])]
        depth = max(100, self.miner.depth()) + self.miner.max_positives
        ranked, sims = index.search(train_queries, depth, cfg.index.search_batch_size,
                                    should_stop)
        table = dual = None
        if self.miner.pool.mines_ann:
            table = self.miner.mine(step, index, train_queries, ranked, sims, self.previous,
                                    should_stop, cfg.index.search_batch_size)
            ctx.store.put_bytes(negatives_key(step), table.to_bytes())
        if self.dance.enabled:
            dual = self.dance.mine(step, ctx.dataset, self.train_ids, index, train_queries)
            ctx.store.put_bytes(negatives_key(f"{step}-dual"), dual.to_bytes())
        diagnostics = self.diagnostics.compute(ranked, self.previous, table)
        return table, dual, diagnostics

    def evaluate(self, index: AnnIndex, queries: np.ndarray, should_stop) -> dict:
        cfg, dataset = self.ctx.config, self.ctx.dataset
        results = {}
        for split in cfg.index.eval_splits:
            qrels = getattr(dataset, split)
            if not qrels:
                continue
            qids = sorted(qrels)
            rows = np.array([self.query_row[q] for q in qids], dtype=np.int64)
            ranked, scores = index.search(queries[rows], cfg.index.eval_depth,
                                          cfg.index.search_batch_size, should_stop)
            run = {q: {str(d): float(s) for d, s in zip(r, sc, strict=True) if d >= 0}
                   for q, r, sc in zip(qids, ranked, scores, strict=True)}
            str_qrels = {q: {str(d): rel for d, rel in rels.items()} for q, rels in qrels.items()}
            results[split] = evaluate(run, str_qrels)
        return results


def serve(ctx: ServiceContext) -> int:
    indexer = Indexer(ctx)
    return ctx.serve(indexer.run, indexer.search.add_to_server)
