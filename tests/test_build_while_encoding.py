"""The indexer adds a checkpoint's shards while the inferencers still encode it
(``index.build_while_encoding``, :mod:`ance_train.indexer.build`).

A real indexer (real Redis, local store, the SciFact subset, an IVF index) is driven by hand:
the test stores embedding shards and publishes their ``shard.encoded`` events the way
inferencers do, out of order and with duplicates, and runs the indexer's loop one iteration
at a time. The vectors are random (no encoder runs: what is tested is when shards go in and
what index they make).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ance_train.config import load_config
from ance_train.data.corpus import open_corpus
from ance_train.data.validation import validate_dataset
from ance_train.index.ann import AnnIndex
from ance_train.indexer.indexer import Indexer
from ance_train.infra.bus import EventBus
from ance_train.infra.store import LocalStore
from ance_train.protocol import keys
from ance_train.protocol.embeddings import pack_embeddings
from ance_train.protocol.events import CheckpointPublished, EvalCompleted, ShardEncoded
from ance_train.protocol.work import RefreshPlan, ShardKind, ShardWork, query_order
from ance_train.runtime import ServiceContext, ServiceOptions

from ance_train_dev.helpers import write_config

DIM = 16


def _indexer(tmp_path: Path, bus: EventBus, data: Path, model: Path,
             build_while_encoding: bool = True) -> Indexer:
    config_path = write_config(
        tmp_path / "run.yaml", run_id=bus.run_id, data={"path": str(data)},
        model={"path": str(model)},
        negatives={"pool": "ann", "warmup": "none", "top_k": 20},
        inference={"shard_size": 50},
        # 2 lists × 39 points: the k-means sample is in after the second shard of 50.
        index={"type": "ivf", "ivf": {"nlist": 2, "nprobe": 1}, "eval_splits": ["test"],
               "build_while_encoding": build_while_encoding})
    config = load_config(config_path)
    ctx = ServiceContext(
        options=ServiceOptions(role="indexer", config_path=str(config_path),
                               redis_url="redis://unused", work_dir=str(tmp_path / "work"),
                               instance="indexer"),
        config=config, log=logging.getLogger("test.build-while-encoding"),
        work_dir=tmp_path / "work", store=LocalStore(config.run_id, tmp_path / "store"),
        redis=bus.client, bus=bus, dataset=validate_dataset(config.data, tmp_path / "cache"),
        corpus=open_corpus(config.data, tmp_path / "cache"), stop=threading.Event())
    indexer = Indexer(ctx)
    indexer.recover()
    return indexer


@pytest.fixture
def indexer(tmp_path: Path, bus: EventBus, scifact_subset: Path, tiny_model: Path) -> Indexer:
    return _indexer(tmp_path, bus, scifact_subset, tiny_model)


def _vectors(work: ShardWork, query_ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """A shard's ids (document indices; query ids in the plan's order) and random,
    reproducible vectors."""
    start, stop = work.start, work.stop
    ids = (np.arange(start, stop, dtype=np.int64) if work.kind == ShardKind.CORPUS
           else np.array(query_ids[start:stop], dtype=np.str_))
    rng = np.random.default_rng([work.step, int(work.kind == ShardKind.QUERIES), start])
    return ids, rng.standard_normal((stop - start, DIM)).astype(np.float32)


def _encode(indexer: Indexer, work: ShardWork, store: bool = True) -> None:
    """What an inferencer does for one item: store the shard, then announce it."""
    ctx = indexer.ctx
    if store:
        vectors = _vectors(work, query_order(ctx.dataset))
        ctx.store.put_bytes(work.key, pack_embeddings(*vectors))
    ctx.bus.publish(ShardEncoded(step=work.step, kind=work.kind, shard=work.shard, key=work.key,
                                 count=work.stop - work.start, instance="inferencer-0",
                                 attempt=1, finished_at=time.time(), seconds=0.1))


def _loop(indexer: Indexer) -> None:
    """The indexer loop until it has nothing to do (``Indexer._run`` without waiting)."""
    while True:
        indexer.poll(block_ms=0)
        step = indexer.newest_complete()
        if step is not None:
            indexer.process(step)
        elif not indexer.add_while_encoding():
            return


def _publish(indexer: Indexer, step: int) -> RefreshPlan:
    plan = RefreshPlan.for_run(step, indexer.ctx.config, indexer.ctx.dataset)
    indexer.ctx.bus.publish(CheckpointPublished(step=step, key=keys.checkpoint(step),
                                                plan=plan))
    return plan


def test_shards_go_in_as_they_are_encoded_in_shard_order(indexer: Indexer) -> None:
    plan = _publish(indexer, 0)
    corpus, queries = plan.work(ShardKind.CORPUS), plan.work(ShardKind.QUERIES)
    assert len(corpus) == 6
    for work in queries:
        _encode(indexer, work)
    _loop(indexer)
    assert indexer.build is not None and indexer.build.added == 0

    # Shard 2 arrives before 1: only shard 0 may go in (shards go in in order).
    _encode(indexer, corpus[0])
    _encode(indexer, corpus[2])
    _loop(indexer)
    assert indexer.build.added == 1
    # A duplicate event of shard 0 (a replayed or reclaimed item) adds nothing.
    _encode(indexer, corpus[0], store=False)
    _loop(indexer)
    assert indexer.build.added == 1
    assert indexer.build.index is not None and indexer.build.index.index is None  # untrained

    _encode(indexer, corpus[1])
    _loop(indexer)
    assert indexer.build.added == 3
    trained = indexer.build.index.index  # trained on shards 0 and 1, while encoding
    assert trained is not None and trained.is_trained and trained.ntotal == 150

    for work in corpus[3:]:
        _encode(indexer, work)
        if work is not corpus[-1]:
            _loop(indexer)
            assert indexer.build.added == work.shard + 1
    assert not list(indexer.ctx.bus.history(EvalCompleted))  # not complete until the last
    _loop(indexer)  # the last shard completes the checkpoint: built, searched, announced
    assert indexer.build is None and indexer.last_built == 0
    (evaluated,) = [r.event for r in indexer.ctx.bus.history(EvalCompleted)]
    assert evaluated.timings["shards_added_early"] == 5

    # The same index as one built after the last shard, bit for bit.
    batch = AnnIndex(DIM, indexer.ctx.config.index, expected_size=plan.num_docs)
    for work in corpus:
        batch.add(*_vectors(work, []))
    batch.finalize()
    probe = np.random.default_rng(7).standard_normal((30, DIM)).astype(np.float32)
    served = indexer.search.served
    assert served is not None and served.step == 0
    for got, want in zip(served.index.search(probe, 10), batch.search(probe, 10), strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_refresh_under_way_is_built_and_a_newer_one_replaces_it(indexer: Indexer) -> None:
    zero = _publish(indexer, 0)
    for work in zero.work(ShardKind.QUERIES) + zero.work(ShardKind.CORPUS):
        _encode(indexer, work)
    _loop(indexer)
    assert indexer.last_built == 0

    three, six = _publish(indexer, 3), _publish(indexer, 6)
    for work in three.work(ShardKind.QUERIES) + three.work(ShardKind.CORPUS)[:2]:
        _encode(indexer, work)
    _encode(indexer, six.work(ShardKind.CORPUS)[0])
    _loop(indexer)
    # The refresh under way is the one with the most shards in, not the newest published.
    assert indexer.encoding_now() == 3
    assert indexer.build is not None and (indexer.build.step, indexer.build.added) == (3, 2)

    for work in six.work(ShardKind.QUERIES) + six.work(ShardKind.CORPUS)[1:3]:
        _encode(indexer, work)
    _loop(indexer)
    # Checkpoint 6 now has more shards in: its build replaces 3's (one build in memory).
    assert indexer.build is not None and (indexer.build.step, indexer.build.added) == (6, 3)

    for work in six.work(ShardKind.CORPUS)[3:]:
        _encode(indexer, work)
    _loop(indexer)
    assert indexer.last_built == 6 and indexer.build is None
    built = [r.event.step for r in indexer.ctx.bus.history(EvalCompleted)]
    assert built == [0, 6]  # 3 was overtaken before it was complete: never announced
    (six_eval,) = [r.event for r in indexer.ctx.bus.history(EvalCompleted) if r.event.step == 6]
    assert six_eval.timings["shards_added_early"] >= 3


def test_off_builds_after_the_last_shard(tmp_path: Path, bus: EventBus, scifact_subset: Path,
                                        tiny_model: Path) -> None:
    indexer = _indexer(tmp_path, bus, scifact_subset, tiny_model, build_while_encoding=False)
    plan = _publish(indexer, 0)
    for work in plan.work(ShardKind.QUERIES) + plan.work(ShardKind.CORPUS)[:-1]:
        _encode(indexer, work)
    _loop(indexer)
    assert indexer.build is None
    _encode(indexer, plan.work(ShardKind.CORPUS)[-1])
    _loop(indexer)
    (evaluated,) = [r.event for r in indexer.ctx.bus.history(EvalCompleted)]
    assert evaluated.timings["shards_added_early"] == 0
