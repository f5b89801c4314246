"""Units of index partitions: shard ownership, the top-K merge (ties, padding, short lists),
the partial-list format and the merged view partition 0 mines over (real FAISS, real local
store)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ance_train.config import IndexConfig
from ance_train.index.ann import AnnIndex
from ance_train.index.merge import canonical_order, merge_topk
from ance_train.indexer.partitions import PARTITION_VAR, MergedIndex, partition_number
from ance_train.infra.store import LocalStore
from ance_train.protocol import keys
from ance_train.protocol.embeddings import pack_embeddings
from ance_train.protocol.events import PartitionSearched
from ance_train.protocol.partials import TopK, pack_partials, unpack_partials
from ance_train.protocol.work import RefreshPlan, ShardKind, partition_of

DIM = 16
FLAT = IndexConfig(device="cpu")


def _corpus(seed: int = 0, docs: int = 500) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((docs, DIM)).astype(np.float32)
    vectors[300:310] = vectors[5]  # exact duplicates: tied scores across shards
    vectors[410:430] = vectors[7]
    queries = rng.standard_normal((60, DIM)).astype(np.float32)
    queries[:4] = vectors[5]
    queries[4:8] = vectors[7]
    return vectors, queries


def _plan(docs: int, shard_size: int) -> RefreshPlan:
    ranges = tuple((s, min(s + shard_size, docs)) for s in range(0, docs, shard_size))
    return RefreshPlan(step=3, corpus_ranges=ranges, query_ranges=((0, 60),))


def _index(vectors: np.ndarray, doc_ids: np.ndarray, config: IndexConfig = FLAT) -> AnnIndex:
    index = AnnIndex(DIM, config, expected_size=len(doc_ids))
    index.add(doc_ids, vectors[doc_ids])
    index.finalize()
    return index


def _partition_lists(plan: RefreshPlan, vectors: np.ndarray, queries: np.ndarray, k: int,
                     partitions: int) -> list[tuple[np.ndarray, np.ndarray]]:
    lists = []
    for partition in range(partitions):
        docs = np.concatenate([np.arange(*plan.corpus_ranges[s])
                               for s in plan.owned_shards(partition, partitions)])
        lists.append(_index(vectors, docs).search(queries, k, batch_size=25))
    return lists


def test_ownership_is_shard_mod_partitions_and_covers_every_shard_once() -> None:
    plan = _plan(1000, 100)
    owned = [plan.owned_shards(p, 3) for p in range(3)]
    assert owned == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert sorted(s for part in owned for s in part) == list(range(10))
    assert all(partition_of(s, 3) == p for p, part in enumerate(owned) for s in part)
    query_key = keys.embedding_shard(3, ShardKind.QUERIES, 0)
    assert plan.partition_keys(1, 3) == {keys.embedding_shard(3, ShardKind.CORPUS, s)
                                         for s in (1, 4, 7)} | {query_key}
    assert list(plan.shard_of_doc(np.array([0, 99, 100, 999]))) == [0, 0, 1, 9]
    with pytest.raises(KeyError):
        plan.shard_of_doc(np.array([1000]))
    with pytest.raises(ValueError):
        partition_of(3, 0)


def test_canonical_order_breaks_ties_by_document_and_puts_padding_last() -> None:
    ids = np.array([[9, -1, 4, 2, 7]])
    scores = np.array([[1.0, -3e38, 2.0, 1.0, 1.0]], dtype=np.float32)
    got_ids, got_scores = canonical_order(ids, scores)
    assert got_ids.tolist() == [[4, 2, 7, 9, -1]]
    assert got_scores[0, :4].tolist() == [2.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("k", [5, 11, 40, 500])
@pytest.mark.parametrize("partitions", [2, 3])
def test_merged_partitions_equal_one_flat_index_with_ties(k: int, partitions: int) -> None:
    vectors, queries = _corpus()
    plan = _plan(len(vectors), 100)
    one_ids, one_scores = _index(vectors, np.arange(len(vectors))).search(queries, k,
                                                                         batch_size=25)
    ids, scores = merge_topk(_partition_lists(plan, vectors, queries, k, partitions), k)
    assert ids.shape == one_ids.shape == (len(queries), min(k, len(vectors)))
    np.testing.assert_array_equal(ids, one_ids)
    np.testing.assert_array_equal(scores, one_scores)
    # The duplicated document's row has eleven tied documents: kept by lowest index first.
    assert ids[0, :min(k, 11)].tolist() == [5, *range(300, 310)][:min(k, 11)]


def test_short_lists_pad_the_merge_to_what_exists() -> None:
    vectors, queries = _corpus(docs=30)
    plan = _plan(30, 10)  # partition 0: shards 0, 2 (20 docs); partition 1: shard 1 (10 docs)
    lists = _partition_lists(plan, vectors, queries, 25, 2)
    assert [part[0].shape[1] for part in lists] == [20, 10]  # each clipped to its documents
    ids, scores = merge_topk(lists, 25)
    assert ids.shape == (60, 25)
    assert (ids >= 0).all() and all(len(set(row)) == 25 for row in ids.tolist())
    # A partition with nothing to offer (padding only) changes nothing.
    empty = (np.full((60, 4), -1, np.int64), np.full((60, 4), -3e38, np.float32))
    again_ids, again_scores = merge_topk([*lists, empty], 25)
    np.testing.assert_array_equal(again_ids, ids)
    np.testing.assert_array_equal(again_scores, scores)
    # A partition that owns no shard (more partitions than shards) has empty lists.
    none = (np.zeros((60, 0), np.int64), np.zeros((60, 0), np.float32))
    np.testing.assert_array_equal(merge_topk([*lists, none], 25)[0], ids)
    # Fewer documents than k in all: the row ends with -1 and score 0.
    few = merge_topk([(np.array([[3, -1]]), np.array([[0.5, -3e38]], np.float32)),
                      (np.array([[8, -1]]), np.array([[0.7, -3e38]], np.float32))], 3)
    assert few[0].tolist() == [[8, 3, -1]]
    assert few[1].tolist() == [[pytest.approx(0.7), 0.5, 0.0]]


def test_merge_rejects_lists_of_different_queries() -> None:
    with pytest.raises(ValueError, match="different query counts"):
        merge_topk([(np.zeros((2, 3), np.int64), np.zeros((2, 3), np.float32)),
                    (np.zeros((3, 3), np.int64), np.zeros((3, 3), np.float32))], 3)
    with pytest.raises(ValueError, match="no partial lists"):
        merge_topk([], 3)


def test_partials_round_trip() -> None:
    groups = {"train": TopK(np.array(["q1", "q2"]), np.array([[4, -1], [2, 3]]),
                            np.array([[0.5, 0.0], [0.25, 0.125]], np.float32)),
              "dev": TopK(np.array(["q9"]), np.array([[7, 8]]),
                          np.array([[1.0, 0.5]], np.float32))}
    doc_vectors = np.arange(6, dtype=np.float32).reshape(2, 3)
    back = unpack_partials(pack_partials(groups, np.array([9, 4]), doc_vectors))
    assert sorted(back.groups) == ["dev", "train"]
    for name, group in groups.items():
        assert back.groups[name].query_ids.tolist() == group.query_ids.tolist()
        np.testing.assert_array_equal(back.groups[name].ids, group.ids)
        np.testing.assert_array_equal(back.groups[name].scores, group.scores)
    assert back.doc_ids.tolist() == [9, 4]
    np.testing.assert_array_equal(back.doc_vectors, doc_vectors)
    assert len(unpack_partials(pack_partials(groups)).doc_ids) == 0
    with pytest.raises(ValueError):
        TopK(np.array(["q"]), np.zeros((1, 2), np.int64), np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match="reserved"):
        pack_partials({"_vectors": groups["dev"]})


def test_partition_searched_rejects_a_partition_out_of_range() -> None:
    with pytest.raises(ValueError):
        PartitionSearched(run_id="r", step=0, partition=2, partitions=2, key="k", documents=1)


def test_partition_number_from_env_or_pod_ordinal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PARTITION_VAR, raising=False)
    assert partition_number("indexer", 1) == 0
    assert partition_number("ance-train-indexer-2", 3) == 2
    with pytest.raises(ValueError, match="ANCE_INDEX_PARTITION"):
        partition_number("indexer", 2)
    with pytest.raises(ValueError, match="out of range"):
        partition_number("ance-train-indexer-3", 3)
    monkeypatch.setenv(PARTITION_VAR, "1")
    assert partition_number("whatever", 2) == 1
    monkeypatch.setenv(PARTITION_VAR, "x")
    with pytest.raises(ValueError, match="not an integer"):
        partition_number("whatever", 2)


def test_merged_view_answers_as_one_flat_index(tmp_path: Path) -> None:
    """Vectors and scores read back from the stored shards, and the exact scan ANCE-Tele's
    lookahead uses, equal one flat index's."""
    vectors, queries = _corpus()
    plan = _plan(len(vectors), 100)
    store = LocalStore("run", tmp_path)
    for work in plan.work(ShardKind.CORPUS):
        store.put_bytes(work.key, pack_embeddings(np.arange(work.start, work.stop),
                                                  vectors[work.start:work.stop]))
    one = _index(vectors, np.arange(len(vectors)))
    view = MergedIndex(store, plan, DIM, cache_shards=2)
    docs = np.array([[499, 0, 250], [5, 305, 101]])
    np.testing.assert_array_equal(view.vectors(docs), one.vectors(docs))
    np.testing.assert_array_equal(view.scores(queries[:2], docs), one.scores(queries[:2], docs))
    assert view.shards_read >= 5  # the five shards these documents lie in (LRU of two)
    # Vectors the partitions sent are used as they are; only the others are read back.
    sent = np.array([250, 0, 499])
    known = MergedIndex(store, plan, DIM, known=(sent, one.vectors(sent) + 1.0))
    np.testing.assert_array_equal(known.vectors(docs[0]), one.vectors(docs[0]) + 1.0)
    assert known.shards_read == 0
    np.testing.assert_array_equal(known.vectors(docs[1]), one.vectors(docs[1]))
    assert known.shards_read == 3
    for k in (7, 30):
        got = view.search(queries, k, batch_size=25)
        want = one.search(queries, k, batch_size=25)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_search_fans_out_over_grpc_and_refuses_mixed_checkpoints(
        tmp_path: Path, redis_server, scifact_subset) -> None:
    """Two partitions' Search servers (real gRPC on loopback, addresses in real Redis): a
    call to either merges both parts into one flat index's answer; partitions on different
    checkpoints, or one not registered, give UNAVAILABLE rather than a mixed answer."""
    import grpc

    from ance_train.config import DataConfig
    from ance_train.data.corpus import open_corpus
    from ance_train.data.validation import validate_dataset
    from ance_train.indexer.search_service import (
        MAX_FAN_OUTS,
        PartitionDirectory,
        SearchService,
        ServedIndex,
    )
    from ance_train.infra.bus import EventBus, connect
    from ance_train.infra.rpc import GrpcServer, ServiceState, search

    data = DataConfig(path=str(scifact_subset))
    dataset = validate_dataset(data, tmp_path / "cache", seed=0)
    corpus = open_corpus(data, tmp_path / "cache")
    docs = dataset.num_docs
    vectors = np.random.default_rng(3).standard_normal((docs, DIM)).astype(np.float32)
    plan = _plan(docs, 40)
    bus = EventBus(connect(redis_server.url), "fan-out")
    services, servers = [], []
    for partition in range(2):
        owned = np.concatenate([np.arange(*plan.corpus_ranges[s])
                                for s in plan.owned_shards(partition, 2)])
        # No model: these searches give embeddings, so no checkpoint is loaded.
        service = SearchService(corpus, None,  # type: ignore[arg-type]
                                directory=PartitionDirectory(bus, partition, 2))
        service.serve(ServedIndex(5, _index(vectors, owned)))
        server = GrpcServer(ServiceState("indexer", "fan-out", f"indexer-{partition}"),
                            add_servicers=service.add_to_server).start()
        bus.client.set(bus.key(keys.index_partition_address(partition)), server.address)
        services.append(service)
        servers.append(server)
    try:
        queries = np.random.default_rng(4).standard_normal((3, DIM)).astype(np.float32)
        want_ids, want_scores = _index(vectors, np.arange(docs)).search(queries, 50)
        for server in servers:
            reply = search(server.address, embeddings=queries.tolist(), k=50)
            assert reply.index_step == 5
            assert [[h.doc_id for h in r.hits] for r in reply.results] == [
                [corpus.doc_id(int(d)) for d in row] for row in want_ids]
            np.testing.assert_array_equal([[h.score for h in r.hits] for r in reply.results],
                                          want_scores)
        # Fan-outs in flight are capped (they never wait holding a gRPC worker).
        for _ in range(MAX_FAN_OUTS):
            services[0]._fan_outs.acquire()
        with pytest.raises(grpc.RpcError) as busy:
            search(servers[0].address, embeddings=queries.tolist(), k=5)
        assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for _ in range(MAX_FAN_OUTS):
            services[0]._fan_outs.release()
        services[1].serve(ServedIndex(6, services[1].served.index))
        with pytest.raises(grpc.RpcError) as mixed:
            search(servers[0].address, embeddings=queries.tolist(), k=5)
        assert mixed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "checkpoints [5, 6]" in mixed.value.details()
        bus.client.delete(bus.key(keys.index_partition_address(0)))
        with pytest.raises(grpc.RpcError) as missing:
            search(servers[1].address, embeddings=queries.tolist(), k=5)
        assert missing.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "partitions [0] are not registered" in missing.value.details()
    finally:
        for server in servers:
            server.stop()
        corpus.close()
