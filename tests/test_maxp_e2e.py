"""MaxP end to end (``data.passages.mode: max``, ANCE arXiv:2007.00808 §5): every service an
OS process, real Redis, real local store.

A reference run (trainer, one inferencer, one indexer; ANCE-Tele negatives, so the lookahead
searches from the best passage of a positive) encodes the SciFact subset's documents as up to
three 32-token passages and refreshes checkpoints 0, 3 and 6. A second run then gets exactly
the reference's stored embedding shards and its ``checkpoint.published`` events, one refresh
at a time (as tests/test_index_partitions.py does), and indexes them with
``index.partitions: 2``: fresh indexer processes that read the stored passage shards back
(passage ids survive a restart), two partitions merging documents by their best passage. The
negatives tables (with the passage of each candidate and positive) and the metrics must be
identical, and ``Retrieval.Search`` through either partition must answer in documents as the
single indexer does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ance_train.data.corpus import open_corpus
from ance_train.data.dataset import load_dataset_index
from ance_train.infra.rpc import search
from ance_train.launcher.redis_server import RedisServer
from ance_train.modeling.model import load_tokenizer
from ance_train.modeling.passages import PassageSplitter
from ance_train.negatives.table import PAD, NegativesTable
from ance_train.protocol import keys
from ance_train.protocol.embeddings import unpack_embeddings, unpack_passages
from ance_train.protocol.events import EvalCompleted, PartitionSearched
from ance_train.protocol.tables import TableId
from ance_train.protocol.work import RefreshPlan, ShardKind

from ance_train_dev.partition_replay import Run, partitioned_replay, reference_run
from ance_train_dev.service_harness import checkpoint_steps

MAX_PASSAGES = 3


def _sections(data: Path, model: Path, run_id: str, partitions: int) -> dict:
    return {
        "run_id": run_id,
        "data": {"path": str(data), "dev_fraction": 0.2,
                 "passages": {"mode": "max", "max_passages": MAX_PASSAGES}},
        "model": {"path": str(model), "max_query_length": 16, "max_doc_length": 32,
                  "similarity": "cosine", "temperature": 0.05},
        "training": {"steps": 6, "batch_size": 8, "refresh_every": 3, "learning_rate": 1e-3,
                     "torch_threads": 1},
        "negatives": {"pool": "tele", "per_query": 2, "warmup": "none", "top_k": 30,
                      "tele": {"max_candidates": 90}},
        "inference": {"shard_size": 50, "claim_timeout_s": 30, "torch_threads": 1},
        "index": {"eval_depth": 100, "partitions": partitions},
    }


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = RedisServer(tmp_path_factory.mktemp("maxp-redis")).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def single(tmp_path_factory, redis_url, scifact_subset, tiny_model) -> Iterator[Run]:
    """The reference: trainer, inferencer and one indexer; the indexer stays up for Search."""
    sections = _sections(scifact_subset, tiny_model, "maxp-one", 1)
    with reference_run(tmp_path_factory.mktemp("maxp-one"), redis_url, sections, 6) as run:
        yield run


@pytest.fixture(scope="module")
def partitioned(tmp_path_factory, redis_url, single, scifact_subset, tiny_model
                ) -> Iterator[Run]:
    """Two fresh index partitions fed the reference's stored shards, one refresh at a time."""
    sections = _sections(scifact_subset, tiny_model, "maxp-two", 2)
    with partitioned_replay(tmp_path_factory.mktemp("maxp-two"), redis_url, sections,
                            single) as run:
        yield run


def _table(run: Run, table: TableId) -> NegativesTable:
    return NegativesTable.from_bytes(run.harness.store.get_bytes(table.key))


def test_corpus_shards_hold_every_passage_of_each_document(single: Run, tiny_model: Path
                                                           ) -> None:
    """Each stored corpus shard has a row per passage: its documents in order, each with the
    passages the splitter cuts (the inferencer's tokenizer, up to three)."""
    harness = single.harness
    config = harness.config
    dataset = load_dataset_index(harness.root / "cache")
    plan = RefreshPlan.for_run(6, config, dataset)
    splitter = PassageSplitter(load_tokenizer(tiny_model), config.data.passages,
                               config.model.max_doc_length)
    corpus = open_corpus(config.data, harness.root / "cache")
    try:
        texts = [text for _, text in corpus.iter_range(0, dataset.num_docs)]
    finally:
        corpus.close()
    counts = np.array([len(spans) for spans in splitter.spans(texts)])
    assert counts.max() == MAX_PASSAGES and (counts > 1).mean() > 0.5, np.bincount(counts)
    for step in single.built:
        for work in plan.work(ShardKind.CORPUS):
            data = harness.store.get_bytes(keys.embedding_shard(step, ShardKind.CORPUS,
                                                                work.shard))
            ids, vectors = unpack_embeddings(data)
            passages = unpack_passages(data)
            assert passages is not None, f"{step} {work.shard}: no passage numbers"
            documents = np.arange(work.start, work.stop)
            assert ids.tolist() == np.repeat(documents, counts[documents]).tolist()
            assert passages.tolist() == [p for d in documents for p in range(counts[d])]
            assert vectors.shape == (len(ids), 32) and np.isfinite(vectors).all()
            several = documents[counts[documents] > 1]
            first = vectors[np.flatnonzero(ids == several[0])]
            assert not np.array_equal(first[0], first[1]), "passages are encoded apart"


def test_two_partitions_give_the_tables_and_metrics_of_one(single: Run, partitioned: Run
                                                           ) -> None:
    assert partitioned.built == single.built
    assert checkpoint_steps(partitioned.bus, EvalCompleted) == single.built, "announced once"
    searched = sorted((e.event.step, e.event.partition)
                      for e in partitioned.bus.history(PartitionSearched))
    assert searched == sorted((s, p) for s in single.built for p in (0, 1)), searched
    dataset = load_dataset_index(single.harness.root / "cache")
    for step in single.built:
        one, two = _table(single, TableId.ann(step)), _table(partitioned, TableId.ann(step))
        for field in dataclasses.fields(NegativesTable):
            a, b = getattr(one, field.name), getattr(two, field.name)
            if isinstance(a, np.ndarray):
                np.testing.assert_array_equal(b, a, err_msg=f"{step} {field.name}")
            else:
                assert a == b, (step, field.name)
        assert one.passages is not None and one.positive_passages is not None
        valid = one.candidates != PAD
        assert (one.passages[valid] > 0).any(), "some negative trains on a later passage"
        assert one.passages.max() < MAX_PASSAGES and one.positive_passages.max() < MAX_PASSAGES
        for row, qid in enumerate(one.query_ids.tolist()):
            positives = set(dataset.positives(qid))
            assert not set(one.candidates[row][valid[row]].tolist()) & positives, qid
            docs = one.positive_docs[row]
            assert set(docs[docs != PAD].tolist()) == positives, qid
        report_one = single.harness.store.get_json(keys.eval_report(step))
        report_two = partitioned.harness.store.get_json(keys.eval_report(step))
        assert report_two["metrics"] == report_one["metrics"]
        assert report_two["diagnostics"] == report_one["diagnostics"]
    first, last = (_table(partitioned, TableId.ann(step)) for step in (0, single.built[-1]))
    assert not np.array_equal(first.candidates, last.candidates), "refreshes differ"
    assert (last.sources != last.sources[0, 0]).any(), "Tele mixes ANN, momentum, lookahead"
    log = partitioned.harness.log("indexer-1")
    assert "partition 1 of 2 searched" in log and "indexed:" not in log, \
        "partition 1 only searches; partition 0 announces"


def test_search_answers_in_documents_through_either_partition(single: Run, partitioned: Run
                                                              ) -> None:
    one = single.bus.services()["indexer:indexer"]
    twos = [partitioned.bus.services()[f"indexer:indexer-{p}"] for p in (0, 1)]
    texts = ["vitamin d deficiency", "cancer cells grow", "protein folding in bacteria"]
    want = search(one, queries=texts, k=25)
    assert want.index_step == single.built[-1]
    vectors = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    want_vectors = search(one, embeddings=vectors.tolist(), k=400)  # more than the corpus
    for reply in (want, want_vectors):
        for result in reply.results:
            ids = [h.doc_id for h in result.hits]
            assert len(ids) == len(set(ids)), "each document once, by its best passage"
            scores = [h.score for h in result.hits]
            assert scores == sorted(scores, reverse=True)
    assert [len(r.hits) for r in want.results] == [25] * 3
    assert [len(r.hits) for r in want_vectors.results] == [300] * 4, "documents, not passages"
    # Either partition fans out. Vector queries only: a text query makes each partition load
    # the encoder (seconds per process), and text encoding is not where passages differ
    # (tests/test_index_partitions.py sends text queries through partitions).
    for address in twos:
        got_vectors = search(address, embeddings=vectors.tolist(), k=400)
        assert got_vectors.index_step == want.index_step
        assert [[(h.doc_id, h.score) for h in r.hits] for r in got_vectors.results] == \
            [[(h.doc_id, h.score) for h in r.hits] for r in want_vectors.results]
