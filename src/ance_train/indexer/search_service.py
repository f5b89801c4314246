"""``Retrieval.Search``: ad-hoc search over the latest index (query texts or embeddings).

Texts are encoded with the index's checkpoint; embeddings are searched as given (inner product
with the stored document vectors), so for a cosine model they should be unit vectors, as the
model's own are.

With index partitions (``index.partitions`` > 1) every partition serves the same endpoint: the
one a user's call reaches encodes the texts, sends the vectors to every other partition's
Search (marked :data:`PARTITION_LOCAL` in the call's metadata, so the callee searches only
its own part and answers with document indices) and merges the lists exactly as the refresh
merges them (:func:`ance_train.index.merge.merge_topk`). All partitions must answer from the
same checkpoint; while a refresh switches them over, the call fails with ``UNAVAILABLE``
and may be retried. A partition runs at most :data:`MAX_FAN_OUTS` fan-outs at once (more
get ``RESOURCE_EXHAUSTED``), so partitions calling each other never wait on each other.

Limits (``index.search``, :class:`ance_train.config.SearchLimits`): queries per request and
hits per query (``INVALID_ARGUMENT``), message size and RPCs in flight (the gRPC server's,
``RESOURCE_EXHAUSTED``). The client's deadline is honoured: the queries are searched in
batches of ``batch_queries`` and between batches (and around encoding) a call whose client
has gone (deadline passed, cancelled) is abandoned, so no worker keeps computing an answer
nobody will read; :attr:`SearchService.abandoned` counts them. A fan-out passes the time the
client has left on to the other partitions.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import grpc
import numpy as np

from ance_train.config import SearchLimits
from ance_train.data.corpus import Corpus
from ance_train.index.ann import AnnIndex
from ance_train.index.merge import merge_topk
from ance_train.index.passages import PassageIndex
from ance_train.infra import bus as bus_module
from ance_train.infra.proto import ance_pb2, ance_pb2_grpc
from ance_train.infra.rpc import channel
from ance_train.modeling.checkpoint_cache import ModelCache
from ance_train.protocol import keys

if TYPE_CHECKING:
    from ance_train.runtime import ServiceContext

MAX_K = SearchLimits().max_k  # the defaults of ``index.search``
MAX_QUERIES = SearchLimits().max_queries
# Metadata of a partition's call to another partition: search your own part only, and answer
# with document indices (decimal, in ``Hit.doc_id``) for the caller to merge.
PARTITION_LOCAL = ("ance-partition-local", "1")
FAN_OUT_TIMEOUT_S = 60.0
ADDRESS_TTL_S = 30
# Fan-outs in flight per partition: at most half of the gRPC server's 8 worker threads, so
# that the partition-local calls of other partitions' fan-outs always find a free worker (two
# partitions each filling every worker with fan-outs to the other would wait on each other).
MAX_FAN_OUTS = 4


@dataclass(frozen=True)
class ServedIndex:
    step: int
    index: AnnIndex | PassageIndex  # MaxP: documents by their best passage


class PartitionDirectory:
    """Where the index partitions' Search servers are: each partition writes its address under
    :func:`ance_train.protocol.keys.index_partition_address` (with a TTL, refreshed)."""

    def __init__(self, bus: bus_module.EventBus, partition: int, partitions: int) -> None:
        self.bus = bus
        self.partition = partition
        self.partitions = partitions
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def start(self, ctx: ServiceContext) -> None:
        """Advertise this partition's address every few seconds until the service stops."""
        assert ctx.server is not None
        address = os.environ.get("ANCE_ADVERTISE_ADDRESS", ctx.server.address)

        def beat() -> None:
            while not ctx.stop.is_set():
                try:
                    self.bus.client.set(self.bus.key(keys.index_partition_address(
                        self.partition)), address, ex=ADDRESS_TTL_S)
                except bus_module.REDIS_UNAVAILABLE as error:  # the next beat retries
                    ctx.log.warning("partition address heartbeat failed: %s", error)
                ctx.stop.wait(5.0)

        threading.Thread(target=beat, name="partition-address", daemon=True).start()

    def address(self, partition: int) -> str | None:
        # The cast: the bus's client decodes replies to str (infra.bus.connect).
        key = self.bus.key(keys.index_partition_address(partition))
        return cast("str | None", self.bus.client.get(key))

    def stub(self, address: str) -> ance_pb2_grpc.RetrievalStub:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = channel(address)
            return ance_pb2_grpc.RetrievalStub(self._channels[address])


class SearchService(ance_pb2_grpc.RetrievalServicer):
    def __init__(self, corpus: Corpus, models: ModelCache, max_query_length: int = 64,
                 directory: PartitionDirectory | None = None,
                 limits: SearchLimits | None = None) -> None:
        self.corpus = corpus
        self.limits = limits or SearchLimits()
        self.abandoned = 0  # calls stopped because their client was gone (deadline, cancel)
        self._abandoned_lock = threading.Lock()
        self.models = models
        self.max_query_length = max_query_length
        self.directory = directory
        self.served: ServedIndex | None = None
        self._pool = (None if directory is None
                      else ThreadPoolExecutor(max(1, directory.partitions - 1)))
        self._fan_outs = threading.BoundedSemaphore(MAX_FAN_OUTS)

    def serve(self, served: ServedIndex) -> None:
        self.served = served  # one reference swap: searches in flight keep the old index

    def add_to_server(self, server: grpc.Server) -> None:
        ance_pb2_grpc.add_RetrievalServicer_to_server(self, server)

    def Search(self, request, context):
        served = self.served
        if served is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no index has been built yet")
        max_k, max_queries = self.limits.max_k, self.limits.max_queries
        if not 1 <= request.k <= max_k:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"k must be in [1, {max_k}], "
                                                            f"got {request.k}")
        if bool(request.queries) == bool(request.embeddings):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "give either queries (texts) or embeddings, not both or neither")
        count = len(request.queries) or len(request.embeddings)
        if count > max_queries:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"at most {max_queries} queries per request, got {count}")
        if request.embeddings:
            dims = {len(e.values) for e in request.embeddings}
            if dims != {served.index.dim}:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"embeddings must have dimension {served.index.dim}, "
                              f"got {sorted(dims)}")
            vectors = np.array([list(e.values) for e in request.embeddings], dtype=np.float32)
        else:
            self._stop_if_gone(context)
            model, tokenizer = self.models.get(served.step)
            from ance_train.modeling.encoding import encode_texts  # transformers: on use

            vectors = encode_texts(model, tokenizer, list(request.queries), kind="query",
                                   max_length=self.max_query_length, device=self.models.device)
        local = PARTITION_LOCAL in tuple(context.invocation_metadata() or ())
        ranked, scores = served.index.search(vectors, request.k, self.limits.batch_queries,
                                             cancel=lambda: self._stop_if_gone(context))
        if self.directory is not None and not local:
            if not self._fan_outs.acquire(blocking=False):  # never wait holding a worker
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{MAX_FAN_OUTS} searches in flight at this partition, retry")
            try:
                ranked, scores = self._fan_out(served.step, vectors, request.k, ranked,
                                               scores, context)
            finally:
                self._fan_outs.release()
        # Partition-local calls answer document indices; the partition the user called names
        # every hit in one batch (a corpus in a bucket: a few ranged GETs).
        found = [int(d) for row in ranked for d in row if d >= 0]
        names = (dict(zip(found, (str(d) for d in found), strict=True)) if local
                 else dict(zip(found, self.corpus.doc_ids(found), strict=True)))
        results = [
            ance_pb2.Hits(hits=[ance_pb2.Hit(doc_id=names[int(d)], score=float(s))
                                for d, s in zip(row, row_scores, strict=True) if d >= 0])
            for row, row_scores in zip(ranked, scores, strict=True)
        ]
        return ance_pb2.SearchReply(index_step=served.step, results=results)

    def _stop_if_gone(self, context) -> None:
        """Abandon the call when its client no longer waits for it (deadline or cancel)."""
        if context.is_active():
            return
        with self._abandoned_lock:
            self.abandoned += 1
        # Nobody reads this status (the client already has DEADLINE_EXCEEDED / CANCELLED);
        # aborting ends the handler and frees the worker.
        context.abort(grpc.StatusCode.CANCELLED, "the client is gone: search abandoned")

    def _fan_out(self, step: int, vectors: np.ndarray, k: int, ranked: np.ndarray,
                 scores: np.ndarray, context) -> tuple[np.ndarray, np.ndarray]:
        """This partition's lists merged with every other partition's for the same vectors."""
        directory = self.directory
        assert directory is not None and self._pool is not None
        others = [p for p in range(directory.partitions) if p != directory.partition]
        addresses = {p: directory.address(p) for p in others}
        missing = [p for p, address in addresses.items() if address is None]
        if missing:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"index partitions {missing} are not registered (starting?)")
        request = ance_pb2.SearchRequest(
            k=k, embeddings=[ance_pb2.Embedding(values=row) for row in vectors.tolist()])

        def call(partition: int) -> ance_pb2.SearchReply:
            address = addresses[partition]
            assert address is not None  # a missing one aborted the call above
            stub = directory.stub(address)
            remaining = context.time_remaining()  # the client's deadline bounds the fan-out
            timeout = FAN_OUT_TIMEOUT_S if remaining is None else min(FAN_OUT_TIMEOUT_S,
                                                                      max(remaining, 0.001))
            return stub.Search(request, timeout=timeout, metadata=(PARTITION_LOCAL,))

        try:
            replies = list(self._pool.map(call, others))
        except grpc.RpcError as error:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"an index partition did not answer: {error.code().name} "
                          f"{error.details()}")
        steps = {step} | {reply.index_step for reply in replies}
        if len(steps) > 1:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"index partitions serve checkpoints {sorted(steps)}: a refresh is "
                          f"being switched over, retry")
        lists = [(ranked, scores)] + [_arrays(reply, len(vectors)) for reply in replies]
        return merge_topk(lists, k)


def _arrays(reply: ance_pb2.SearchReply, queries: int) -> tuple[np.ndarray, np.ndarray]:
    """A partition-local reply's hits as ``-1``-padded arrays of document indices and scores."""
    width = max((len(hits.hits) for hits in reply.results), default=0)
    ids = np.full((queries, width), -1, dtype=np.int64)
    scores = np.zeros((queries, width), dtype=np.float32)
    for row, hits in enumerate(reply.results):
        for column, hit in enumerate(hits.hits):
            ids[row, column] = int(hit.doc_id)
            scores[row, column] = hit.score
    return ids, scores
