"""The events the services exchange on Redis Streams, one typed model per event.

Every event is a JSON object in the stream entry's ``data`` field. It carries the run id
and the schema ``version``; readers validate it against the model of its stream (unknown
fields, missing fields, wrong types and other versions are rejected), and the bus
dead-letters what does not validate instead of handing it to a handler
(:class:`ance_train.infra.bus.EventBus`). Handlers must be idempotent: redelivery can
repeat an event.

| event | published by | when |
|---|---|---|
| ``checkpoint.published`` | trainer | a checkpoint is stored and its shard work queued |
| ``shard.encoded`` | inferencer | one embedding shard is stored |
| ``shard.failed`` | inferencer | an item was given up (its checkpoint cannot be read) |
| ``partition.searched`` | indexer partition | its top-K lists of every query are stored |
| ``negatives.ready`` | indexer | negatives tables are stored (BM25 at start, then per refresh) |
| ``negatives.in_use`` | trainer | which refresh tables it may still read changed (retention) |
| ``eval.completed`` | indexer | a refresh's metrics are stored |
| ``run.finished`` | trainer | the last step is done |
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ance_train.protocol.message import MalformedMessage, Message
from ance_train.protocol.tables import TableId, TableKind
from ance_train.protocol.work import RefreshPlan, ShardKind


class Event(Message):
    """A fact one service announces to the others (see the table above)."""


class CheckpointPublished(Event):
    TYPE: ClassVar[str] = "checkpoint.published"

    step: int = Field(ge=0)
    key: str  # the checkpoint's prefix in the store
    plan: RefreshPlan
    # The refresh timeline (:mod:`ance_train.observability.timeline`), Unix wall-clock times
    # of the trainer: the local save of the model's files in the loop, their upload on the
    # publisher thread (up to WEIGHTS.json), and the moment its work was about to be queued
    # (replicas may claim it from then on; this event follows). The training state is saved
    # and uploaded after these, MANIFEST.json last (:mod:`ance_train.protocol.checkpoints`).
    # None: not recorded (an older trainer, or a checkpoint announced again by a restarted
    # trainer).
    save_started_at: float | None = None
    saved_at: float | None = None
    upload_started_at: float | None = None
    uploaded_at: float | None = None
    published_at: float | None = None

    @model_validator(mode="after")
    def _plan_of_this_step(self) -> CheckpointPublished:
        if self.plan.step != self.step:
            raise ValueError(f"plan of step {self.plan.step} in the event of step {self.step}")
        return self


class ShardEncoded(Event):
    TYPE: ClassVar[str] = "shard.encoded"

    step: int = Field(ge=0)
    kind: ShardKind
    shard: int = Field(ge=0)
    key: str
    count: int = Field(ge=0)  # texts in the shard
    instance: str  # the inferencer replica that encoded it
    attempt: int = Field(ge=1)  # delivery of the work item (≥ 2: it was reclaimed)
    finished_at: float  # Unix time the shard was stored
    seconds: float  # load + encode + upload
    load_s: float = 0.0
    encode_s: float = 0.0
    upload_s: float = 0.0
    wait_s: float = 0.0  # waiting for the previous shard's upload
    # The refresh timeline, Unix wall-clock times of the replica (None: not recorded): item
    # claimed, checkpoint loaded, texts tokenised (or their cached ids found), encoded, and
    # the upload started (``finished_at``: stored). ``tokenize_s`` is included in
    # ``encode_s``; ``model_reloaded``: the whole model was built (False: kept resident,
    # only its weights replaced, or already the checkpoint's); ``tokens_cached``: the
    # shard's token ids came from the replica's cache.
    claimed_at: float | None = None
    loaded_at: float | None = None
    tokenized_at: float | None = None
    encoded_at: float | None = None
    upload_started_at: float | None = None
    tokenize_s: float = 0.0
    model_reloaded: bool | None = None
    tokens_cached: bool | None = None


class ShardFailed(Event):
    """An item given up on: its checkpoint cannot be read (corrupt or missing) after
    ``inference.max_attempts`` deliveries. The checkpoint is abandoned; later ones go on."""

    TYPE: ClassVar[str] = "shard.failed"

    step: int = Field(ge=0)
    kind: ShardKind
    shard: int = Field(ge=0)
    key: str  # the shard that could not be produced
    instance: str
    attempt: int = Field(ge=1)
    error: str  # names the object that could not be read


class PartitionSearched(Event):
    """Index partition ``partition`` of ``partitions`` built its index of checkpoint ``step``
    over the corpus shards it owns (:func:`ance_train.protocol.work.partition_of`) and stored
    its local top-K lists of every query under ``key``
    (:func:`ance_train.protocol.keys.partial_results`). Once the event of every partition
    is out, partition 0 merges the lists, mines, evaluates and announces the refresh."""

    TYPE: ClassVar[str] = "partition.searched"

    step: int = Field(ge=0)
    partition: int = Field(ge=0)
    partitions: int = Field(ge=2)
    key: str
    documents: int = Field(ge=0)  # documents in the partition's index
    build_s: float = 0.0  # after the partition's last shard arrived
    search_s: float = 0.0
    shards_added_early: int = Field(0, ge=0)  # added while the checkpoint was still encoding

    @model_validator(mode="after")
    def _partition_in_range(self) -> PartitionSearched:
        if self.partition >= self.partitions:
            raise ValueError(f"partition {self.partition} of {self.partitions}")
        return self


class NegativesReady(Event):
    """Tables stored and ready to use: BM25 alone, or a refresh's ANN and/or DANCE tables."""

    TYPE: ClassVar[str] = "negatives.ready"

    tables: tuple[TableId, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_checkpoint(self) -> NegativesReady:
        if len({t.step for t in self.tables}) != 1 or len({t.kind for t in self.tables}) != len(
                self.tables):
            raise ValueError("tables must be of one checkpoint, at most one of each kind")
        return self

    @property
    def step(self) -> int | None:
        """The checkpoint that mined the tables; None for the BM25 table."""
        return self.tables[0].step

    def table(self, kind: TableKind) -> TableId | None:
        return next((t for t in self.tables if t.kind is kind), None)


class TablesInUse(Event):
    """The trainer's promise about the refresh objects it may still read from the store.

    Published (by rank 0) whenever it changes: after the feed swapped to a newer table, and
    once a checkpoint is complete (a resumed trainer reloads the tables its newest complete
    checkpoint held). The indexer deletes a refresh's objects only below ``needed_from``
    (``store.keep_refreshes``; :mod:`ance_train.protocol.retention`), so a deletion never
    races the trainer. ``needed_from`` only grows over a run, restarts included.
    """

    TYPE: ClassVar[str] = "negatives.in_use"

    step: int = Field(ge=0)  # the trainer's step when it announced
    tables: tuple[TableId, ...] = ()  # what the training loop samples from now
    # The lowest refresh whose tables the trainer may still read: the minimum of the tables
    # it holds and those its newest complete (or uploading) checkpoint holds; 0 while it
    # waits for its first refresh table; None when it reads no refresh table at all (its
    # strategies use none).
    needed_from: int | None = Field(None, ge=0)


class IndexerTimes(BaseModel):
    """When the indexer did what for one refresh (Unix wall-clock seconds of its host):
    the plan complete (its last shard's ``shard.encoded`` read), the index finished (the shards
    not added while encoding, then finalised), the training queries searched, the negatives
    mined and stored, the evaluation done (its searches take ``eval_search_s``), and the
    moment the report and then ``negatives.ready`` were about to be written
    (``announced_at``). With index partitions (partition 0's merge) "build" is reading the
    partitions' lists and "search" is empty: the partitions built and searched before."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    complete_at: float | None = None
    build_started_at: float
    built_at: float
    searched_at: float
    mined_at: float
    evaluated_at: float
    eval_search_s: float = 0.0
    announced_at: float
    mining_parallel_to_eval: bool = False  # mining and evaluation ran at the same time


class EvalCompleted(Event):
    TYPE: ClassVar[str] = "eval.completed"

    step: int = Field(ge=0)
    key: str  # the evaluation report in the store
    metrics: dict[str, dict[str, float]]  # split -> measure -> value
    timings: dict[str, float] = Field(default_factory=dict)  # build_s, mine_s, eval_s
    diagnostics: dict[str, Any] = Field(default_factory=dict)
    # The indexer's part of the refresh timeline, Unix wall-clock times (None: not recorded).
    times: IndexerTimes | None = None


class RunFinished(Event):
    TYPE: ClassVar[str] = "run.finished"

    step: int = Field(ge=0)  # the final step


EVENT_TYPES: dict[str, type[Event]] = {
    cls.TYPE: cls for cls in (CheckpointPublished, ShardEncoded, ShardFailed, PartitionSearched,
                              NegativesReady, TablesInUse, EvalCompleted, RunFinished)
}


__all__ = ["EVENT_TYPES", "CheckpointPublished", "EvalCompleted", "Event", "IndexerTimes",
           "MalformedMessage",
           "NegativesReady", "PartitionSearched", "RunFinished", "ShardEncoded", "ShardFailed",
           "TablesInUse"]
