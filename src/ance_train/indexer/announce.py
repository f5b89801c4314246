"""A refresh's outcome, behind one call (:meth:`Announcer.refresh`): mine the negatives,
evaluate, serve the index, store the report, announce ``negatives.ready`` and
``eval.completed``, then track the refresh and sweep the superseded refreshes' objects.
Also the BM25 warm-up negatives, mined once at start-up.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from ance_train.evaluation import CI_MEASURE, evaluate_with_interval, format_interval
from ance_train.index.ann import AnnIndex
from ance_train.index.passages import PassageIndex
from ance_train.indexer.diagnostics import Diagnostics
from ance_train.indexer.partitions import MergedIndex
from ance_train.indexer.search_service import SearchService, ServedIndex
from ance_train.indexer.shards import QueryVectors
from ance_train.indexer.tracker import RefreshTracker
from ance_train.infra.bus import REDIS_UNAVAILABLE, EventBus, entry_seconds
from ance_train.infra.retention import RunRetention
from ance_train.infra.store import StorageError
from ance_train.negatives.mining import Miner, positives_of
from ance_train.negatives.strategies.bm25 import bm25_negatives
from ance_train.negatives.table import NegativesTable, store_table
from ance_train.observability.telemetry import IndexerTelemetry
from ance_train.observability.timeline import refresh_timeline
from ance_train.observability.timeline import scalars as timeline_scalars
from ance_train.observability.tracking import Tracking, flatten, open_tracking
from ance_train.protocol import keys
from ance_train.protocol.events import EvalCompleted, IndexerTimes, NegativesReady
from ance_train.protocol.partials import TopK
from ance_train.protocol.tables import TableId, TableKind
from ance_train.runtime import ServiceContext

if TYPE_CHECKING:
    from ance_train.negatives.strategies.base import VectorIndex
    from ance_train.negatives.strategies.dance import DanceLoss

#: What a refresh mines and evaluates over: one index, or partition 0's merged view.
SearchedIndex = AnnIndex | MergedIndex | PassageIndex


class Announcer:
    """Mines, evaluates and announces the refreshes of the process that announces them (the
    single indexer, or partition 0); ``tracking``: where their scalars go."""

    def __init__(self, ctx: ServiceContext, tracker: RefreshTracker, search: SearchService,
                 announces: bool) -> None:
        self.ctx = ctx
        self.tracker = tracker
        self.search = search
        self.announces = announces
        # Partition 0 reports the refreshes; the other partitions have no scalars to track.
        self.tracking = (open_tracking(ctx.config, "indexer", ctx.store, ctx.work_dir)
                         if announces else Tracking([]))
        cfg = ctx.config
        self.train_ids = sorted(ctx.dataset.train)
        self.miner = Miner(cfg.negatives, cfg.model.temperature, ctx.dataset, self.train_ids,
                           cfg.training.seed)
        # DANCE's negative queries (when on); the cast: the registry's "dance" is DanceLoss.
        self.dance = cast("DanceLoss", cfg.negatives.strategy("dance"))
        self.diagnostics = Diagnostics(self.train_ids, positives_of(ctx.dataset, self.train_ids),
                                       cfg.training.seed)
        self.previous: NegativesTable | None = None
        self.telemetry = IndexerTelemetry(ctx.reporter)
        # store.keep_refreshes: the indexer alone deletes per-refresh objects (retention.py).
        self.retention = RunRetention(ctx.bus, ctx.store, cfg.store.keep_refreshes, None)

    def recover(self, bus: EventBus) -> None:
        """The newest checkpoint whose ``negatives.ready`` or ``eval.completed`` went out is
        the last one built; its ANN table is the previous one (when this process mines)."""
        done = [r.event for r in bus.history(NegativesReady) if r.event.step is not None]
        evaluated = [r.event.step for r in bus.history(EvalCompleted)]
        built = [e.step for e in done if e.step is not None] + evaluated
        self.tracker.last_built = max(built, default=None)
        latest = max(done, key=lambda e: e.step or 0, default=None)
        table = None if latest is None else latest.table(TableKind.ANN)
        if table is not None and self.announces:
            self.previous = NegativesTable.from_bytes(self.ctx.store.get_bytes(table.key))

    def train_depth(self) -> int:
        """How deep the training queries are searched: the mining's candidates plus room for
        the positives removed (and at least the diagnostics' top 100)."""
        return max(100, self.miner.depth()) + self.miner.max_positives

    def publish_bm25_negatives(self) -> None:
        ctx = self.ctx
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

    def refresh(self, step: int, index: SearchedIndex, queries: QueryVectors,
                cancel: Callable[[], None], marks: dict[str, float],
                timings: dict[str, float], merged: dict[str, TopK] | None = None,
                served: ServedIndex | None = None, later: dict[str, float] | None = None,
                announcing: Callable[[], None] | None = None) -> None:
        """Mine, evaluate, serve ``served`` (if any) and announce the refresh of ``step``.
        ``merged``: the partitions' merged lists (else ``index`` is searched here);
        ``timings``: the stage seconds before mining, ``later`` those reported after it;
        ``announcing``: called once evaluated, before anything is announced."""
        ctx = self.ctx
        ctx.state.update(phase=f"mining {step}")
        started = time.monotonic()
        table, dual, diagnostics = self.mine(step, index, queries, cancel,
                                             None if merged is None else merged["train"], marks)
        mine_s = time.monotonic() - started
        marks["mined_at"] = time.time()

        ctx.state.update(phase=f"evaluating {step}")
        started = time.monotonic()
        intervals: dict[str, dict[str, list[float]]] = {}
        metrics = self.evaluate(index, queries, cancel, merged, marks, intervals)
        eval_s = time.monotonic() - started
        marks["evaluated_at"] = time.time()
        timings = {**timings, "mine_s": mine_s, "eval_s": eval_s, **(later or {})}
        if served is not None:  # the index serves searches from now on; then the events
            self.search.serve(served)
        if announcing is not None:
            announcing()
        self._announce(step, table, dual, diagnostics, metrics, timings, marks, intervals)

    def mine(self, step: int, index: SearchedIndex, queries: QueryVectors,
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
            if marks is not None:
                marks["searched_at"] = time.time()
        else:
            if list(searched.query_ids) != self.train_ids:
                raise ValueError("merged training lists are not in training-query order")
            ranked, sims = searched.ids, searched.scores
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

    def evaluate(self, index: SearchedIndex, queries: QueryVectors,
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
        if marks is not None and searched is None:
            marks["eval_search_s"] = search_s
        return results

    def _announce(self, step: int, table: NegativesTable | None, dual: NegativesTable | None,
                  diagnostics: dict, metrics: dict, timings: dict, marks: dict,
                  intervals: dict | None = None) -> None:
        """Store the evaluation report, then publish ``negatives.ready`` and
        ``eval.completed`` of ``step`` (the tables are stored already). ``marks``: the
        indexer's times of the refresh timeline; ``intervals``: split → measure → the
        bootstrap 95% interval (the report's ``ci95``, :func:`~ance_train.evaluation.
        bootstrap_ci`)."""
        ctx, tracker = self.ctx, self.tracker
        times = IndexerTimes(complete_at=tracker.completed_wall.get(step),
                             announced_at=time.time(), **marks)
        timeline = self._timeline(step, times)
        ctx.store.put_json(keys.eval_report(step), {"step": step, "metrics": metrics,
                                                    "timings": timings,
                                                    "ci95": intervals or {},
                                                    "diagnostics": diagnostics,
                                                    "times": times.model_dump(),
                                                    "timeline": timeline})
        tracker.last_built = step
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
        done = entry_seconds(ready_id or eval_id)
        published, completed = tracker.published_at.get(step), tracker.completed_at.get(step)
        # Checkpoint published → its negatives ready; the tail: its last shard encoded →
        # negatives ready (None when the shards were in the store at start-up). Both by the
        # Redis server's clock.
        refresh_s = None if published is None else done - published
        self.telemetry.refreshed(step, refresh_s, metrics)
        self._track(step, refresh_s, None if completed is None else done - completed, timings,
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
        tracker.announced(step)
        self.retain()

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
        published = self.tracker.published.get(step)
        if published is None:
            return None
        try:
            return refresh_timeline(published, self.tracker.shard_events.get(step, {}).values(),
                                    times)
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
