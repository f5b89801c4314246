"""Index partitions end to end: P = 2 indexer processes give what one indexer gives.

Real Redis, real local store, every service an OS process. A reference run (trainer,
inferencer, one indexer, flat index, ANCE-Tele negatives with DANCE's dual loss, so the
merged view serves the Tele lookahead search, the stored vectors and the momentum table)
refreshes checkpoints 0, 3 and 6. A second run then gets exactly the reference's stored
embedding shards and checkpoints, and its ``checkpoint.published`` events one refresh at a
time (the trainer and inferencer are not started again, so both runs index the same
vectors), and indexes them with ``index.partitions: 2``: two indexer processes, partition 0
merging. The negatives tables, DANCE tables, metrics and diagnostics must be identical, each
refresh announced once, and ``Retrieval.Search`` through either partition must answer as the
single indexer does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ance_train.infra.rpc import search
from ance_train.launcher.redis_server import RedisServer
from ance_train.negatives.table import NegativesTable
from ance_train.protocol import keys
from ance_train.protocol.events import EvalCompleted, PartitionSearched
from ance_train.protocol.tables import TableId

from ance_train_dev.partition_replay import Run, partitioned_replay, reference_run
from ance_train_dev.service_harness import checkpoint_steps


def _sections(data: Path, model: Path, run_id: str, partitions: int) -> dict:
    return {
        "run_id": run_id,
        "data": {"path": str(data), "dev_fraction": 0.2},
        "model": {"path": str(model), "max_query_length": 16, "max_doc_length": 32,
                  "similarity": "cosine", "temperature": 0.05},
        "training": {"steps": 6, "batch_size": 8, "refresh_every": 3, "torch_threads": 1},
        "negatives": {"pool": "tele", "per_query": 2, "warmup": "none", "top_k": 30,
                      "tele": {"max_candidates": 90},
                      "dance": {"dual_weight": 0.1, "top_k": 10}},
        "inference": {"shard_size": 50, "claim_timeout_s": 30, "torch_threads": 1},
        "index": {"eval_depth": 100, "partitions": partitions},
    }


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = RedisServer(tmp_path_factory.mktemp("partitions-redis")).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def single(tmp_path_factory, redis_url, scifact_subset, tiny_model) -> Iterator[Run]:
    """The reference: trainer, inferencer and one indexer; the indexer stays up for Search."""
    sections = _sections(scifact_subset, tiny_model, "parts-one", 1)
    with reference_run(tmp_path_factory.mktemp("partitions-one"), redis_url, sections, 6) as run:
        yield run


@pytest.fixture(scope="module")
def partitioned(tmp_path_factory, redis_url, single, scifact_subset, tiny_model
                ) -> Iterator[Run]:
    """Two fresh index partitions fed the reference's stored shards, one refresh at a time."""
    sections = _sections(scifact_subset, tiny_model, "parts-two", 2)
    with partitioned_replay(tmp_path_factory.mktemp("partitions-two"), redis_url, sections,
                            single) as run:
        yield run


def _table(run: Run, table: TableId) -> NegativesTable:
    return NegativesTable.from_bytes(run.harness.store.get_bytes(table.key))


def test_two_partitions_give_the_tables_and_metrics_of_one(single: Run, partitioned: Run
                                                           ) -> None:
    assert partitioned.built == single.built
    assert checkpoint_steps(partitioned.bus, EvalCompleted) == single.built, "announced once"
    searched = sorted((e.event.step, e.event.partition)
                      for e in partitioned.bus.history(PartitionSearched))
    assert searched == sorted((s, p) for s in single.built for p in (0, 1)), searched
    for step in single.built:
        for table_id in (TableId.ann(step), TableId.dual(step)):
            one, two = _table(single, table_id), _table(partitioned, table_id)
            for field in dataclasses.fields(NegativesTable):
                a, b = getattr(one, field.name), getattr(two, field.name)
                if isinstance(a, np.ndarray):
                    np.testing.assert_array_equal(b, a, err_msg=f"{table_id} {field.name}")
                else:
                    assert a == b, (table_id, field.name)
        report_one = single.harness.store.get_json(keys.eval_report(step))
        report_two = partitioned.harness.store.get_json(keys.eval_report(step))
        assert report_two["metrics"] == report_one["metrics"]
        assert report_two["diagnostics"] == report_one["diagnostics"]
        assert set(report_two["timings"]) >= {"build_s", "search_s", "merge_s", "mine_s",
                                              "eval_s"}
    last = _table(partitioned, TableId.ann(single.built[-1]))
    assert (last.sources != last.sources[0, 0]).any(), "Tele mixes ANN, momentum, lookahead"
    log = partitioned.harness.log("indexer-1")
    assert "partition 1 of 2 searched" in log and "indexed:" not in log, \
        "partition 1 only searches; partition 0 announces"


def test_search_over_two_partitions_equals_one(single: Run, partitioned: Run) -> None:
    one = single.bus.services()["indexer:indexer"]
    twos = [partitioned.bus.services()[f"indexer:indexer-{p}"] for p in (0, 1)]
    texts = ["vitamin d deficiency", "cancer cells grow", "protein folding in bacteria"]
    want = search(one, queries=texts, k=25)
    assert want.index_step == single.built[-1]
    vectors = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    want_vectors = search(one, embeddings=vectors.tolist(), k=400)  # more than the corpus
    assert [len(r.hits) for r in want_vectors.results] == [300] * 4
    for address in twos:  # either partition fans out
        got = search(address, queries=texts, k=25)
        assert got.index_step == want.index_step
        assert [[(h.doc_id, h.score) for h in r.hits] for r in got.results] == \
            [[(h.doc_id, h.score) for h in r.hits] for r in want.results]
        got_vectors = search(address, embeddings=vectors.tolist(), k=400)
        assert [[(h.doc_id, h.score) for h in r.hits] for r in got_vectors.results] == \
            [[(h.doc_id, h.score) for h in r.hits] for r in want_vectors.results]
