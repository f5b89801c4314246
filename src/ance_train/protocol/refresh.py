"""One index refresh: which shards a checkpoint is cut into and where each artefact lives.

The trainer publishes the plan with the checkpoint; inferencers encode its shards; the
indexer waits until every shard of the plan is in the store. Keys are relative to the run.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from ance_train.config import RunConfig
from ance_train.data.dataset import DatasetIndex, shard_ranges

CORPUS = "corpus"
QUERIES = "queries"
# Checkpoint 0 is the untrained encoder: its refresh is the zero-shot reference every run is
# compared against and the first ANN negatives, so no newer checkpoint ever supersedes it.
ZERO_SHOT_STEP = 0


def checkpoint_prefix(step: int) -> str:
    return f"checkpoints/{step}"


def embedding_key(step: int, kind: str, shard: int) -> str:
    return f"embeddings/{step}/{kind}-{shard:05d}.npz"


def negatives_key(step: int | str) -> str:
    return f"negatives/{step}.npz"


def eval_key(step: int) -> str:
    return f"eval/{step}.json"


def query_order(dataset: DatasetIndex) -> list[str]:
    """Every query that gets encoded at a refresh, in a fixed order: train, dev, test."""
    ordered: list[str] = []
    seen: set[str] = set()
    for split in (dataset.train, dataset.dev, dataset.test):
        for qid in sorted(split):
            if qid not in seen:
                seen.add(qid)
                ordered.append(qid)
    return ordered


@dataclass(frozen=True)
class RefreshPlan:
    step: int
    corpus_ranges: list[tuple[int, int]]
    query_ranges: list[tuple[int, int]]

    @classmethod
    def for_run(cls, step: int, config: RunConfig, dataset: DatasetIndex) -> RefreshPlan:
        return cls(
            step,
            shard_ranges(dataset.num_docs, config.inference.shard_size),
            shard_ranges(len(query_order(dataset)), config.inference.query_shard_size),
        )

    def expected_keys(self) -> set[str]:
        keys = {embedding_key(self.step, CORPUS, i) for i in range(len(self.corpus_ranges))}
        keys |= {embedding_key(self.step, QUERIES, i) for i in range(len(self.query_ranges))}
        return keys

    def to_payload(self) -> dict:
        return {"corpus_ranges": self.corpus_ranges, "query_ranges": self.query_ranges}

    @classmethod
    def from_payload(cls, step: int, payload: dict) -> RefreshPlan:
        return cls(step, [tuple(r) for r in payload["corpus_ranges"]],
                   [tuple(r) for r in payload["query_ranges"]])


def pack_embeddings(ids: np.ndarray, vectors: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, ids=ids.astype(np.int64), vectors=vectors.astype(np.float32))
    return buffer.getvalue()


def unpack_embeddings(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
        return arrays["ids"], arrays["vectors"]
