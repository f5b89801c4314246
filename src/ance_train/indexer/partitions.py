"""Index partitions (``index.partitions`` > 1): which one this process is, and the merged view
partition 0 mines and evaluates over.

Partition ``p`` builds the index of the corpus shards it owns
(:func:`ance_train.protocol.work.partition_of`), searches every query and stores its local
top-K lists (:mod:`ance_train.protocol.partials`). Partition 0 merges the lists
(:func:`ance_train.index.merge.merge_topk`) and runs the mining, the diagnostics and the
evaluation once, on a :class:`MergedIndex`: the searches the partitions ran, plus the
document vectors read back from the stored embedding shards (what a flat index holds).
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from ance_train.index.ann import AnnIndex, blockwise_scores
from ance_train.index.capacity import MERGE_CACHE_SHARDS
from ance_train.index.merge import merge_topk
from ance_train.infra.env import PARTITION_VAR
from ance_train.infra.store import ObjectStore
from ance_train.protocol.embeddings import documents_of, unpack_rows
from ance_train.protocol.work import RefreshPlan, ShardKind


def partition_number(instance: str, partitions: int) -> int:
    """This indexer's partition: ``ANCE_INDEX_PARTITION`` when set (the embedded mode), else
    the ordinal ending a StatefulSet pod's name (``<release>-indexer-<ordinal>``, the instance
    name in the chart). 0 when there is one partition."""
    raw = os.environ.get(PARTITION_VAR)
    if raw is None and partitions == 1:
        return 0
    if raw is None:
        match = re.search(r"-(\d+)$", instance)
        if match is None:
            raise ValueError(f"index.partitions is {partitions}: set {PARTITION_VAR} or run as a "
                             f"StatefulSet pod whose name ends in -<ordinal> (instance "
                             f"{instance!r})")
        raw = match.group(1)
    try:
        partition = int(raw)
    except ValueError:
        raise ValueError(f"{PARTITION_VAR}={raw!r} is not an integer") from None
    if not 0 <= partition < partitions:
        raise ValueError(f"index partition {partition} out of range: index.partitions is "
                         f"{partitions} (partitions 0..{partitions - 1})")
    return partition


class MergedIndex:
    """What the mining code asks of an index (``dim``, ``vectors``, ``scores``, ``search``),
    answered without any one process holding the whole index.

    ``vectors`` takes the vectors the partitions sent with their lists (``known``: the
    training positives, as each partition's index holds them) and reads any other
    document's embedding back from the stored corpus shards (the vectors a flat index holds;
    an ``ivfpq`` index would return PQ reconstructions).
    ``search`` is needed only by ANCE-Tele's lookahead (neighbours of the positive documents);
    it is an exact scan of the stored shards, merged as partitions merge, so for a flat index
    it equals one index's search and for approximate types it is exact rather than
    approximate. A few shards are kept in memory (``cache_shards``).

    With MaxP (``max_passages`` set) its rows are passages, keyed as the partitions' indexes
    key them (:func:`~ance_train.protocol.embeddings.passage_keys`); wrapped in a
    :class:`~ance_train.index.passages.PassageIndex` it answers in documents.
    """

    def __init__(self, store: ObjectStore, plan: RefreshPlan, dim: int,
                 cache_shards: int = MERGE_CACHE_SHARDS,
                 known: tuple[np.ndarray, np.ndarray] | None = None,
                 max_passages: int | None = None) -> None:
        self.store = store
        self.plan = plan
        self.dim = dim
        self.max_passages = max_passages
        self.cache_shards = max(1, cache_shards)
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        # Vectors the partitions sent with their lists (the training positives), by document.
        ids, vectors = known if known is not None else (np.zeros(0, np.int64), None)
        order = np.argsort(ids, kind="stable")
        self._known_ids = np.asarray(ids, dtype=np.int64)[order]
        self._known_vectors = (np.zeros((0, dim), np.float32) if vectors is None
                               else np.asarray(vectors, np.float32).reshape(-1, dim)[order])
        self.shards_read = 0  # corpus shards read back from the store (a measurement)

    def __len__(self) -> int:
        return self.plan.num_docs

    def _shard(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        if shard in self._cache:
            self._cache.move_to_end(shard)
            return self._cache[shard]
        work = self.plan.work(ShardKind.CORPUS)[shard]
        ids, vectors = unpack_rows(self.store.get_bytes(work.key), self.max_passages)
        self.shards_read += 1
        if vectors.shape[1] != self.dim:
            raise ValueError(f"{work.key}: dimension {vectors.shape[1]}, expected {self.dim}")
        entry = (np.asarray(ids, dtype=np.int64), np.ascontiguousarray(vectors, np.float32))
        self._cache[shard] = entry
        while len(self._cache) > self.cache_shards:
            self._cache.popitem(last=False)
        return entry

    def _known(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Which of ``flat`` the partitions sent, and where they are among the known."""
        if not len(self._known_ids):
            return np.zeros(len(flat), dtype=bool), np.zeros(len(flat), dtype=np.int64)
        pos = np.minimum(np.searchsorted(self._known_ids, flat), len(self._known_ids) - 1)
        return self._known_ids[pos] == flat, pos

    def _in_shards(self, flat: np.ndarray
                   ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Per corpus shard holding some of ``flat``: (their positions in ``flat``, whether
        the shard has each, its row of each, the shard's vectors)."""
        documents = flat if self.max_passages is None else documents_of(flat, self.max_passages)
        shards = self.plan.shard_of_doc(documents)
        found = []
        for shard in np.unique(shards):
            wanted = np.flatnonzero(shards == shard)
            ids, vectors = self._shard(int(shard))
            # Shards are stored in corpus order; look rows up by id all the same.
            order = np.argsort(ids, kind="stable")
            pos = np.minimum(np.searchsorted(ids[order], flat[wanted]), len(ids) - 1)
            found.append((wanted, ids[order][pos] == flat[wanted], order[pos], vectors))
        return found

    def present(self, doc_ids: np.ndarray) -> np.ndarray:
        """Whether each of ``doc_ids`` (row keys) is stored."""
        flat = np.asarray(doc_ids, dtype=np.int64).ravel()
        out, _ = self._known(flat)
        rest = np.flatnonzero(~out)
        for wanted, found, _, _ in self._in_shards(flat[rest]):
            out[rest[wanted]] = found
        return out

    def best_vectors(self, queries: np.ndarray, doc_ids: np.ndarray) -> np.ndarray:
        """The document's one vector (see :meth:`AnnIndex.best_vectors`)."""
        return self.vectors(doc_ids)

    def vectors(self, doc_ids: np.ndarray) -> np.ndarray:
        """The stored embeddings of ``doc_ids`` (row keys: document indices, or passage keys
        with MaxP; any shape)."""
        flat = np.asarray(doc_ids, dtype=np.int64).ravel()
        out = np.zeros((len(flat), self.dim), dtype=np.float32)
        known, pos = self._known(flat)
        out[known] = self._known_vectors[pos[known]]
        rest = np.flatnonzero(~known)
        for wanted, found, rows, vectors in self._in_shards(flat[rest]):
            if not found.all():
                raise KeyError(f"documents not in their shard: "
                               f"{flat[rest[wanted]][~found][:5].tolist()}")
            out[rest[wanted]] = vectors[rows]
        return out.reshape(*np.shape(doc_ids), self.dim)

    def scores(self, queries: np.ndarray, doc_ids: np.ndarray) -> np.ndarray:
        """Inner product of each query row with the vectors of its ``doc_ids`` row."""
        return blockwise_scores(self.vectors, self.dim, queries, doc_ids)

    def search(self, queries: np.ndarray, k: int, batch_size: int = 1024,
               cancel: Callable[[], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-``k`` by inner product over every stored corpus shard (see the class)."""
        from ance_train.config import IndexConfig

        queries = np.ascontiguousarray(queries, dtype=np.float32)
        k = min(k, len(self) * (self.max_passages or 1))  # MaxP: rows are passages
        best = (np.full((len(queries), 0), -1, np.int64), np.zeros((len(queries), 0), np.float32))
        for shard in range(len(self.plan.corpus_ranges)):
            if cancel is not None:
                cancel()
            ids, vectors = self._shard(shard)
            index = AnnIndex(self.dim, IndexConfig(type="flat", device="cpu"))
            index.add(ids, vectors)
            index.finalize()
            # The batches of ``AnnIndex.search`` over one index (FAISS scores a batch of ≥ 20
            # queries with BLAS and a smaller one without): the same batches, the same bits.
            best = merge_topk([best, index.search(queries, k, batch_size, cancel)], k)
        return best
