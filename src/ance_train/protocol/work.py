"""One index refresh: which shards a checkpoint is cut into, and the shard work items.

The trainer puts the plan in ``checkpoint.published`` and one :class:`ShardWork` per shard
on the work stream; inferencers encode the shards; the indexer waits until every shard of
the plan is in the store.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ance_train.protocol import keys
from ance_train.protocol.message import Message

if TYPE_CHECKING:
    from ance_train.config import RunConfig
    from ance_train.data.dataset import DatasetIndex

# Checkpoint 0 is the untrained encoder: its refresh is the zero-shot reference every run is
# compared against and the first ANN negatives, so no newer checkpoint ever supersedes it.
ZERO_SHOT_STEP = 0


class ShardKind(StrEnum):
    CORPUS = "corpus"  # documents [start, stop) of the corpus file, ids = document indices
    QUERIES = "queries"  # queries [start, stop) of :func:`query_order`, ids = query ids


CORPUS = ShardKind.CORPUS
QUERIES = ShardKind.QUERIES


def partition_of(shard: int, partitions: int) -> int:
    """The index partition that owns corpus shard ``shard`` when the indexer runs as
    ``partitions`` processes (``index.partitions``): ``shard mod partitions``.

    Fixed by the shard number alone, so every process (and a restarted one) agrees without
    coordination, and consecutive shards, which hold neighbouring documents, are spread over
    the partitions (every partition's share grows alike while a refresh is encoded).
    """
    if partitions < 1 or shard < 0:
        raise ValueError(f"partition_of({shard}, {partitions}): need shard >= 0, partitions >= 1")
    return shard % partitions

Range = tuple[int, int]


def query_order(dataset: DatasetIndex) -> list[str]:
    """Every query that gets encoded at a refresh, in a fixed order: train, dev, test.

    Only the plan's ranges and the inferencer use this order; the query shards it writes
    carry the query ids themselves, so no reader depends on the order.
    """
    ordered: list[str] = []
    seen: set[str] = set()
    for split in (dataset.train, dataset.dev, dataset.test):
        for qid in sorted(split):
            if qid not in seen:
                seen.add(qid)
                ordered.append(qid)
    return ordered


def shard_ranges(num_items: int, shard_size: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` ranges of at most ``shard_size`` items covering all."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be at least 1, got {shard_size}")
    if num_items < 0:
        raise ValueError(f"num_items must not be negative, got {num_items}")
    return [(s, min(s + shard_size, num_items)) for s in range(0, num_items, shard_size)]


class RefreshPlan(BaseModel):
    """The shards of checkpoint ``step``: half-open ranges of documents and of queries."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step: int = Field(ge=0)
    corpus_ranges: tuple[Range, ...]
    query_ranges: tuple[Range, ...]

    @classmethod
    def for_run(cls, step: int, config: RunConfig, dataset: DatasetIndex) -> RefreshPlan:
        return cls(
            step=step,
            corpus_ranges=tuple(shard_ranges(dataset.num_docs, config.inference.shard_size)),
            query_ranges=tuple(shard_ranges(len(query_order(dataset)),
                                            config.inference.query_shard_size)),
        )

    def ranges(self, kind: ShardKind) -> tuple[Range, ...]:
        return self.corpus_ranges if kind is ShardKind.CORPUS else self.query_ranges

    def work(self, kind: ShardKind) -> list[ShardWork]:
        """One work item per shard of ``kind``."""
        return [ShardWork(step=self.step, kind=kind, shard=shard, start=start, stop=stop)
                for shard, (start, stop) in enumerate(self.ranges(kind))]

    def expected_keys(self) -> set[str]:
        return {keys.embedding_shard(self.step, kind, shard)
                for kind in ShardKind for shard in range(len(self.ranges(kind)))}

    def owned_shards(self, partition: int, partitions: int) -> list[int]:
        """The corpus shards index partition ``partition`` of ``partitions`` builds."""
        return [shard for shard in range(len(self.corpus_ranges))
                if partition_of(shard, partitions) == partition]

    def partition_keys(self, partition: int, partitions: int) -> set[str]:
        """What a partition needs before it builds: its corpus shards and every query shard
        (each partition searches every query)."""
        return ({keys.embedding_shard(self.step, ShardKind.CORPUS, shard)
                 for shard in self.owned_shards(partition, partitions)}
                | {keys.embedding_shard(self.step, ShardKind.QUERIES, shard)
                   for shard in range(len(self.query_ranges))})

    def shard_of_doc(self, doc_ids: np.ndarray) -> np.ndarray:
        """The corpus shard holding each document index (ranges are contiguous from 0)."""
        starts = np.array([start for start, _ in self.corpus_ranges], dtype=np.int64)
        doc_ids = np.asarray(doc_ids, dtype=np.int64)
        if len(doc_ids) and (doc_ids.min() < 0 or doc_ids.max() >= self.num_docs):
            raise KeyError(f"document indices outside [0, {self.num_docs}) in refresh plan "
                           f"{self.step}")
        return np.searchsorted(starts, doc_ids, side="right") - 1

    @property
    def num_docs(self) -> int:
        return self.corpus_ranges[-1][1] if self.corpus_ranges else 0


class ShardWork(Message):
    """One item of the work stream: encode texts [start, stop) of ``kind`` with checkpoint
    ``step`` and store them as shard ``shard``."""

    TYPE: ClassVar[str] = "work"

    step: int = Field(ge=0)
    kind: ShardKind
    shard: int = Field(ge=0)
    start: int = Field(ge=0)
    stop: int = Field(ge=0)

    @model_validator(mode="after")
    def _range(self) -> ShardWork:
        if self.stop < self.start:
            raise ValueError(f"empty range: stop {self.stop} < start {self.start}")
        return self

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.shard:05d}"

    @property
    def key(self) -> str:
        """Where the encoded shard is stored."""
        return keys.embedding_shard(self.step, self.kind, self.shard)
