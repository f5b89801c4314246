"""Limits of the indexer's ``Retrieval.Search`` (``index.search``; docs/reliability.md, "Search
under load"), over real gRPC on loopback and a real FAISS index: an oversized message, more
RPCs in flight than the cap, and a client deadline shorter than the search."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from ance_train.config import DataConfig, SearchLimits
from ance_train.data.corpus import open_corpus
from ance_train.data.validation import validate_dataset
from ance_train.index.ann import AnnIndex
from ance_train.indexer.search_service import SearchService, ServedIndex
from ance_train.infra.proto import ance_pb2, ance_pb2_grpc
from ance_train.infra.rpc import GrpcServer, ServiceState, channel, search

DIM = 128
ROWS = 60_000  # enough rows that a 1024-query search takes a noticeable time on 2 cores


def _index() -> AnnIndex:
    index = AnnIndex(DIM)
    rng = np.random.default_rng(0)
    # Rows name the 300 documents of the subset over and over: the ranking is irrelevant
    # here, only that each search does ROWS × queries × DIM of real FAISS work.
    index.add(np.arange(ROWS) % 300, rng.normal(size=(ROWS, DIM)).astype(np.float32))
    index.finalize()
    return index


@pytest.fixture
def served(tmp_path: Path, scifact_subset: Path) -> Iterator:
    cfg = DataConfig(path=str(scifact_subset))
    validate_dataset(cfg, tmp_path / "cache")
    corpus = open_corpus(cfg, tmp_path / "cache")
    index = _index()
    servers: list[GrpcServer] = []

    def start(limits: SearchLimits, max_workers: int = 8) -> tuple[str, SearchService]:
        service = SearchService(corpus, models=None, limits=limits)
        service.serve(ServedIndex(1, index))
        server = GrpcServer(ServiceState("indexer", "limits", "indexer"),
                            add_servicers=service.add_to_server, max_workers=max_workers,
                            max_message_bytes=limits.max_message_bytes,
                            max_concurrent_rpcs=limits.max_concurrent_rpcs).start()
        servers.append(server)
        return server.address, service

    yield start
    for server in servers:
        server.stop(grace_s=0.1)


def _request(queries: int, k: int = 10) -> ance_pb2.SearchRequest:
    vectors = np.random.default_rng(1).normal(size=(queries, DIM)).astype(np.float32)
    return ance_pb2.SearchRequest(k=k, embeddings=[ance_pb2.Embedding(values=row)
                                                   for row in vectors.tolist()])


def test_message_over_the_limit_is_resource_exhausted(served) -> None:
    limits = SearchLimits(max_message_bytes=64 * 1024)
    address, _ = served(limits)
    request = _request(200)  # 200 × 128 floats ≈ 100 KB, over 64 KiB
    assert request.ByteSize() > limits.max_message_bytes
    with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as info:
        ance_pb2_grpc.RetrievalStub(ch).Search(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (f"Received message larger than max ({request.ByteSize()} vs. "
            f"{limits.max_message_bytes})") in info.value.details()
    # A reply over the limit is refused the same way, on the server's side.
    with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as info:
        ance_pb2_grpc.RetrievalStub(ch).Search(_request(100, k=1000), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "Sent message larger than max" in info.value.details()
    reply = search(address, embeddings=[[0.5] * DIM], k=3)  # still serving
    assert len(reply.results[0].hits) == 3


def test_more_rpcs_than_the_cap_are_refused_at_once_and_none_hangs(served) -> None:
    address, _ = served(SearchLimits(max_concurrent_rpcs=2), max_workers=2)
    request = _request(512)
    with channel(address) as ch:
        stub = ance_pb2_grpc.RetrievalStub(ch)
        assert stub.Search(_request(1), timeout=30).results  # channel connected
        started = time.monotonic()
        calls = [stub.Search.future(request, timeout=60) for _ in range(12)]
        outcomes = []
        for call in calls:
            try:
                outcomes.append((call.result(timeout=60).index_step, ""))
            except grpc.RpcError as error:
                outcomes.append((error.code(), error.details()))
        elapsed = time.monotonic() - started
    refused = [o for o in outcomes if o[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    answered = [o for o in outcomes if o[0] == 1]
    assert len(refused) + len(answered) == 12, outcomes  # every call ended, nothing else
    assert answered and refused, outcomes
    assert all(details == "Concurrent RPC limit exceeded!" for _, details in refused)
    assert elapsed < 60


def test_search_stops_when_the_client_deadline_passes(served) -> None:
    limits = SearchLimits(batch_queries=8)
    address, service = served(limits)
    request = _request(1024)
    with channel(address) as ch:
        stub = ance_pb2_grpc.RetrievalStub(ch)
        started = time.monotonic()
        stub.Search(request, timeout=120)
        full = time.monotonic() - started  # the whole search, for comparison
        deadline = min(0.5, full / 4)
        with pytest.raises(grpc.RpcError) as info:
            stub.Search(request, timeout=deadline)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The server notices between two batches of 8 queries and stops: its worker is free
    # long before the whole search would have ended.
    waited = time.monotonic()
    while service.abandoned == 0 and time.monotonic() - waited < full:
        time.sleep(0.01)
    assert service.abandoned == 1, f"the search ran on after the deadline ({full:.2f} s)"


def test_corpus_names_documents_correctly_from_many_threads(tmp_path: Path,
                                                            scifact_subset: Path) -> None:
    """Search workers name hits concurrently through one corpus handle (this raced with
    seek + readline: 'the corpus file changed since validation')."""
    from concurrent.futures import ThreadPoolExecutor

    cfg = DataConfig(path=str(scifact_subset))
    validate_dataset(cfg, tmp_path / "cache")
    corpus = open_corpus(cfg, tmp_path / "cache")
    order = list(range(len(corpus)))[::-1]
    expected = corpus.doc_ids(order)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: corpus.doc_ids(order), range(64)))
    assert all(answer == expected for answer in answers)
