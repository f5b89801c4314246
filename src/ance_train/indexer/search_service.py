"""``Retrieval.Search``: ad-hoc search over the latest index (query texts or embeddings).

Texts are encoded with the index's checkpoint; embeddings are searched as given (inner product
with the stored document vectors), so for a cosine model they should be unit vectors, as the
model's own are.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import numpy as np

from ance_train.data.corpus import Corpus
from ance_train.index.ann import AnnIndex
from ance_train.infra.proto import ance_pb2, ance_pb2_grpc
from ance_train.modeling.checkpoint_cache import ModelCache
from ance_train.modeling.encoding import encode_texts

MAX_K = 10000
MAX_QUERIES = 1024


@dataclass(frozen=True)
class ServedIndex:
    step: int
    index: AnnIndex


class SearchService(ance_pb2_grpc.RetrievalServicer):
    def __init__(self, corpus: Corpus, models: ModelCache, max_query_length: int = 64) -> None:
        self.corpus = corpus
        self.models = models
        self.max_query_length = max_query_length
        self.served: ServedIndex | None = None

    def serve(self, served: ServedIndex) -> None:
        self.served = served  # one reference swap: searches in flight keep the old index

    def add_to_server(self, server: grpc.Server) -> None:
        ance_pb2_grpc.add_RetrievalServicer_to_server(self, server)

    def Search(self, request, context):
        served = self.served
        if served is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no index has been built yet")
        if not 1 <= request.k <= MAX_K:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"k must be in [1, {MAX_K}], "
                                                            f"got {request.k}")
        if bool(request.queries) == bool(request.embeddings):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "give either queries (texts) or embeddings, not both or neither")
        count = len(request.queries) or len(request.embeddings)
        if count > MAX_QUERIES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"at most {MAX_QUERIES} queries per request, got {count}")
        if request.embeddings:
            dims = {len(e.values) for e in request.embeddings}
            if dims != {served.index.dim}:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"embeddings must have dimension {served.index.dim}, "
                              f"got {sorted(dims)}")
            vectors = np.array([list(e.values) for e in request.embeddings], dtype=np.float32)
        else:
            model, tokenizer = self.models.get(served.step)
            vectors = encode_texts(model, tokenizer, list(request.queries),
                                   max_length=self.max_query_length, device=self.models.device)
        ranked, scores = served.index.search(vectors, request.k)
        # The ids of every hit in one batch (a corpus in a bucket: a few ranged GETs).
        found = [(int(d), float(s)) for row, row_scores in zip(ranked, scores, strict=True)
                 for d, s in zip(row, row_scores, strict=True) if d >= 0]
        names = dict(zip((d for d, _ in found),
                         self.corpus.doc_ids([d for d, _ in found]), strict=True))
        results = [
            ance_pb2.Hits(hits=[ance_pb2.Hit(doc_id=names[int(d)], score=float(s))
                                for d, s in zip(row, row_scores, strict=True) if d >= 0])
            for row, row_scores in zip(ranked, scores, strict=True)
        ]
        return ance_pb2.SearchReply(index_step=served.step, results=results)
