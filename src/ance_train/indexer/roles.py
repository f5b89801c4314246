"""What one indexer process builds, chosen once at start: :class:`SingleIndexRole` (one
indexer: builds the whole index, then mines, evaluates and announces) or
:class:`PartitionRole` (``index.partitions`` > 1: builds and searches its part, stores its
top-K lists); both build while the inferencers encode (:class:`BuildingRole`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ance_train.index.ann import AnnIndex
from ance_train.index.passages import PassageIndex
from ance_train.indexer.announce import Announcer
from ance_train.indexer.build import ShardedBuild
from ance_train.indexer.search_service import SearchService, ServedIndex
from ance_train.indexer.shards import QueryVectors, ShardReader
from ance_train.indexer.tracker import RefreshTracker
from ance_train.infra.bus import EventBus
from ance_train.protocol import keys
from ance_train.protocol.events import PartitionSearched
from ance_train.protocol.partials import TopK, pack_partials
from ance_train.protocol.work import RefreshPlan, ShardKind
from ance_train.runtime import ServiceContext

#: ``cancel_for(step, following)``: the check a build calls between batches; it raises
#: ``Superseded`` once ``following()`` (the next checkpoint to do) supersedes ``step``.
CancelFor = Callable[[int, Callable[[], int | None]], Callable[[], None]]


class BuildingRole:
    """Builds this process's index of a checkpoint from the shards it needs, shard by shard,
    while they are encoded (``index.build_while_encoding``)."""

    def __init__(self, ctx: ServiceContext, tracker: RefreshTracker, reader: ShardReader,
                 announcer: Announcer, search: SearchService, cancel_for: CancelFor) -> None:
        self.ctx = ctx
        self.tracker = tracker
        self.reader = reader
        self.announcer = announcer
        self.search = search
        self.cancel_for = cancel_for
        self.build: ShardedBuild | None = None  # the index being built, maybe while encoding

    # -- what this role does with a plan (the subclasses) -----------------------------------
    def needed(self, plan: RefreshPlan) -> set[str]:
        """The shards this process waits for before it builds ``plan``."""
        raise NotImplementedError

    def shards(self, plan: RefreshPlan) -> list[int]:
        """The corpus shards of ``plan`` this process's index holds."""
        raise NotImplementedError

    def newest_complete(self) -> int | None:
        """The checkpoint to build next (see :mod:`ance_train.protocol.supersession`)."""
        raise NotImplementedError

    def work(self, step: int) -> None:
        """Build ``step`` and do what this role does with it."""
        raise NotImplementedError

    def recover(self, bus: EventBus) -> None:
        """Read back this role's state from the streams (before the plans)."""

    def recovered(self) -> None:
        """Log what :meth:`recover` found."""

    def start(self) -> None:
        """Before the loop: start what this role serves."""

    # -- building ---------------------------------------------------------------------------
    def cancel(self, step: int) -> Callable[[], None]:
        return self.cancel_for(step, self.newest_complete)

    def encoding_now(self) -> int | None:
        return self.tracker.encoding_now(self.needed)

    def drop(self, step: int) -> None:
        """``step`` was abandoned: its partial build goes."""
        if self.build is not None and self.build.step == step:
            self.build = None

    def build_of(self, step: int) -> ShardedBuild:
        """The build of ``step`` under way, else a new one. One build at a time bounds the
        memory: a partial build of another checkpoint is dropped."""
        if self.build is not None and self.build.step != step:
            self.ctx.log.info("dropping the partial index of checkpoint %d (%d of %d shards): "
                              "building %d", self.build.step, self.build.added,
                              len(self.build.shards), step)
            self.build = None
        if self.build is None:
            plan = self.tracker.plans[step]
            shards = self.shards(plan)
            size = sum(plan.corpus_ranges[shard][1] - plan.corpus_ranges[shard][0]
                       for shard in shards)
            self.build = ShardedBuild(step, shards, size, self.ctx.config.index)
        return self.build

    def _add_next(self, build: ShardedBuild, early: bool = False) -> None:
        shard = build.next_shard()
        assert shard is not None
        ids, vectors = self.reader.shard(build.step, ShardKind.CORPUS, shard)
        build.add(ids, vectors, early)

    def documents(self, index: AnnIndex, step: int, shards: list[int]
                  ) -> AnnIndex | PassageIndex:
        """``index`` as the rest of the indexer searches it: by documents (MaxP: its
        passages collapsed to documents, ``shards`` telling how many documents it holds)."""
        max_passages = self.reader.max_passages
        if max_passages is None:
            return index
        ranges = self.tracker.plans[step].corpus_ranges
        return PassageIndex(index, max_passages, sum(ranges[s][1] - ranges[s][0] for s in shards))

    def add_next_encoded(self) -> tuple[int, Callable[[int], None]] | None:
        """No checkpoint is complete: the checkpoint being encoded and the work that adds its
        next shard, if that is in the store (shards go in in order), else None."""
        if not self.ctx.config.index.build_while_encoding:
            return None
        step = self.encoding_now()
        if step is None:
            return None
        build = self.build_of(step)
        shard = build.next_shard()
        if shard is None or (self.tracker.plans[step].work(ShardKind.CORPUS)[shard].key
                             not in self.tracker.received.get(step, set())):
            return None
        # The phase says so (Status), the state stays: this is work between events.
        self.ctx.state.update(phase=f"building index {step}")
        return step, lambda _: self._add_next(build, early=True)

    def index(self, step: int, cancel: Callable[[], None]
              ) -> tuple[AnnIndex | PassageIndex, QueryVectors, int]:
        """``step``'s index over this process's shards (those added while encoding and the
        rest), its query vectors and how many shards went in while encoding."""
        build = self.build_of(step)
        while build.next_shard() is not None:
            cancel()
            self._add_next(build)
        queries = self.reader.queries(step, self.tracker.plans[step])
        index = self.documents(build.finish(queries.vectors.shape[1]), step, build.shards)
        self.build = None
        return index, queries, build.added_early


class SingleIndexRole(BuildingRole):
    """One indexer: the whole corpus in one index; it mines, evaluates and announces."""

    def needed(self, plan: RefreshPlan) -> set[str]:
        return plan.expected_keys()

    def shards(self, plan: RefreshPlan) -> list[int]:
        return list(range(len(plan.corpus_ranges)))

    def newest_complete(self) -> int | None:
        return self.tracker.newest_complete(self.needed, self.tracker.last_built)

    def work(self, step: int) -> None:
        ctx = self.ctx
        cancel = self.cancel(step)
        started = time.monotonic()
        marks: dict[str, float] = {"build_started_at": time.time()}  # the refresh timeline
        ctx.state.update(state="running", phase=f"building index {step}", checkpoint_step=step)
        index, queries, early = self.index(step, cancel)
        build_s = time.monotonic() - started
        marks["built_at"] = time.time()
        self.announcer.refresh(step, index, queries, cancel, marks, {"build_s": build_s},
                               served=ServedIndex(step, index),
                               later={"shards_added_early": float(early)})


class PartitionRole(BuildingRole):
    """``index.partitions`` > 1, partition ``partition``: builds the index of the corpus
    shards it owns, searches every training and evaluation query, stores its top-K lists and
    publishes ``partition.searched``."""

    def __init__(self, ctx: ServiceContext, tracker: RefreshTracker, reader: ShardReader,
                 announcer: Announcer, search: SearchService, cancel_for: CancelFor,
                 partition: int, partitions: int) -> None:
        super().__init__(ctx, tracker, reader, announcer, search, cancel_for)
        self.partition, self.partitions = partition, partitions
        # The training positives: each partition sends the vectors of those it owns with its
        # lists (the anchors and DANCE's documents the merge mines with).
        self.positive_docs = np.array(sorted({d for q in announcer.train_ids
                                              for d in ctx.dataset.positives(q)}),
                                      dtype=np.int64)

    def needed(self, plan: RefreshPlan) -> set[str]:
        return plan.partition_keys(self.partition, self.partitions)

    def shards(self, plan: RefreshPlan) -> list[int]:
        return plan.owned_shards(self.partition, self.partitions)

    def newest_complete(self) -> int | None:
        return self.tracker.newest_complete(self.needed, self.tracker.last_searched)

    def recover(self, bus: EventBus) -> None:
        for searched in bus.history(PartitionSearched):
            event = searched.event
            if event.partitions != self.partitions:
                continue  # lists of another partitioning (index.partitions changed)
            if event.partition == self.partition:
                self.tracker.last_searched = max(event.step, self.tracker.last_searched or 0)
            self.tracker.partition_searched(event)

    def recovered(self) -> None:
        last = self.tracker.last_searched
        self.ctx.log.info("partition %d of %d: last searched checkpoint %s", self.partition,
                          self.partitions, "none" if last is None else last)

    def start(self) -> None:
        assert self.search.directory is not None  # made when partitions > 1
        self.search.directory.start(self.ctx)  # where Search fans out to

    def work(self, step: int) -> None:
        """Build this partition's index of ``step``, search every query, store the top-K
        lists and announce them (``partition.searched``)."""
        ctx = self.ctx
        cancel = self.cancel(step)
        started = time.monotonic()
        ctx.state.update(state="running", phase=f"building index {step}", checkpoint_step=step)
        plan = self.tracker.plans[step]
        index, queries, early = self.index(step, cancel)
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
        self.tracker.last_searched = step
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
        self.tracker.part_searched(step)

    def search_groups(self, index: AnnIndex | PassageIndex, queries: QueryVectors,
                      cancel: Callable[[], None]) -> dict[str, TopK]:
        """The top-K lists a refresh needs: the training queries at the mining depth, each
        evaluated split's queries at ``index.eval_depth`` (the searches one index runs in
        ``Announcer.mine`` and ``Announcer.evaluate``, query for query and batch for batch)."""
        cfg, batch = self.ctx.config, self.ctx.config.index.search_batch_size
        train_ids = self.announcer.train_ids
        groups = {"train": TopK(np.array(train_ids),
                                *index.search(queries.of(train_ids),
                                              self.announcer.train_depth(), batch, cancel))}
        for split in cfg.index.eval_splits:
            qids = sorted(getattr(self.ctx.dataset, split))
            if qids:
                groups[split] = TopK(np.array(qids), *index.search(
                    queries.of(qids), cfg.index.eval_depth, batch, cancel))
        return groups
