"""The store lifecycle (``store.keep_refreshes`` / ``keep_checkpoints``; the rules in
protocol/retention.py, the actor in infra/retention.py): what is deleted, what never is.
Real stores (a local directory and the moto S3 server on loopback), real Redis for the
events the rules read, the trainer's real negatives feed."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from ance_train.infra.bus import EventBus
from ance_train.infra.retention import RunRetention
from ance_train.infra.rpc import GrpcServer, ServiceState, fetch_status
from ance_train.infra.store import LocalStore, ObjectStore, S3Store
from ance_train.negatives.table import NegativesTable
from ance_train.protocol import keys
from ance_train.protocol.checkpoints import complete_checkpoints
from ance_train.protocol.events import (
    EvalCompleted,
    NegativesReady,
    RunFinished,
    TablesInUse,
)
from ance_train.protocol.retention import checkpoints_to_delete
from ance_train.protocol.selection import DevPoint, best_step
from ance_train.protocol.tables import TableId
from ance_train.trainer.negatives_feed import NegativesFeed, TablesAnnouncer

REFRESHES = (0, 2, 4, 6)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return LocalStore("run", tmp_path / "store")
    env = request.getfixturevalue("s3_env")
    return S3Store(f"run-{uuid.uuid4().hex[:8]}", env["ANCE_S3_ENDPOINT"],
                   env["ANCE_S3_ACCESS_KEY"], env["ANCE_S3_SECRET_KEY"],
                   env["ANCE_S3_BUCKET"], retry_seconds=5.0)


def refresh_objects(step: int) -> list[str]:
    """What a refresh leaves: shards, ANN and DANCE tables, and an object of a kind the code
    does not know yet (a partition's partial list) under a per-refresh family."""
    return [keys.embedding_shard(step, "corpus", 0), keys.embedding_shard(step, "corpus", 1),
            keys.embedding_shard(step, "queries", 0), TableId.ann(step).key,
            TableId.dual(step).key, f"{keys.embeddings(step)}/partition-1/partial-00000.npz",
            f"{keys.NEGATIVES}/{step}-partial-1.npz"]


def checkpoint_objects(step: int, complete: bool = True) -> list[str]:
    files = ["model.safetensors", "config.json", "training_state.json"]
    return [f"{keys.checkpoint(step)}/{name}" for name in
            files + (["MANIFEST.json"] if complete else [])]


KEPT_ALWAYS = [keys.DATASET_INDEX, keys.DOC_OFFSETS, keys.RUN_CONFIG, keys.TRAINER_SUMMARY,
               TableId.bm25().key, *(keys.eval_report(s) for s in REFRESHES)]


def fill(store: ObjectStore, names: list[str]) -> dict[str, int]:
    sizes = {}
    for i, key in enumerate(names):
        data = bytes([i % 251]) * (100 + i)
        store.put_bytes(key, data)
        sizes[key] = len(data)
    return sizes


def refreshes_built(bus: EventBus, steps=REFRESHES, dev: dict[int, float] | None = None) -> None:
    bus.publish(NegativesReady(tables=(TableId.bm25(),)))
    for step in steps:
        bus.publish(NegativesReady(tables=(TableId.ann(step), TableId.dual(step))))
        ndcg = (dev or {}).get(step, 0.1 + step / 100)
        bus.publish(EvalCompleted(step=step, key=keys.eval_report(step),
                                  metrics={"dev": {"ndcg@10": ndcg}, "test": {"ndcg@10": 0.9}}))


@pytest.fixture
def filled(store: ObjectStore) -> dict[str, int]:
    return fill(store, KEPT_ALWAYS + [k for s in REFRESHES for k in refresh_objects(s)]
                + refresh_objects(5))  # 5: encoded, then superseded by 6 before its build


def test_refresh_step_of_every_key_family() -> None:
    assert keys.refresh_step("embeddings/12/corpus-00003.npz") == 12
    assert keys.refresh_step("negatives/12.npz") == 12
    assert keys.refresh_step("negatives/12-dual.npz") == 12
    assert keys.refresh_step(keys.partial_results(12, 1, 2)) == 12
    assert keys.refresh_step("negatives/bm25.npz") is None
    assert keys.refresh_step("negatives/12x.npz") is None
    assert keys.refresh_step("checkpoints/12/MANIFEST.json") is None
    assert keys.refresh_step("eval/12.json") is None
    assert keys.refresh_step(keys.DATASET_INDEX) is None


def test_deletes_exactly_the_superseded_refreshes(store: ObjectStore, bus: EventBus,
                                                  filled: dict[str, int]) -> None:
    refreshes_built(bus)
    bus.publish(TablesInUse(step=7, tables=(TableId.ann(6),), needed_from=6))
    before = store.usage()
    sweep = RunRetention(bus, store, keep_refreshes=2, keep_checkpoints=None).sweep_refreshes()
    gone = [k for s in (0, 2, 5) for k in refresh_objects(s)]
    assert sorted(sweep.keys) == sorted(gone)
    assert set(store.list()) == set(filled) - set(gone)
    assert sweep.bytes == sum(filled[k] for k in gone) == before - store.usage()
    if isinstance(store, LocalStore):  # no empty directory of a deleted refresh is left
        assert not (store.root / "run" / keys.embeddings(0)).exists()


def test_never_the_table_the_trainer_still_samples_from(store: ObjectStore, bus: EventBus,
                                                        filled: dict[str, int]) -> None:
    refreshes_built(bus)
    # The trainer is still on table 2 (its newest checkpoint holds it) while 4 and 6 are ready.
    bus.publish(TablesInUse(step=5, tables=(TableId.ann(2),), needed_from=2))
    retention = RunRetention(bus, store, keep_refreshes=1, keep_checkpoints=None)
    assert sorted(retention.sweep_refreshes().keys) == sorted(refresh_objects(0))
    assert set(store.list()) == set(filled) - set(refresh_objects(0))
    # It swaps to 6 and checkpoints with it: everything below 6 may go, 6 stays.
    bus.publish(TablesInUse(step=9, tables=(TableId.ann(6),), needed_from=6))
    gone = [k for s in (2, 4, 5) for k in refresh_objects(s)]
    assert sorted(retention.sweep_refreshes().keys) == sorted(gone)
    left = set(store.list())
    assert left == set(filled) - set(refresh_objects(0)) - set(gone)
    assert set(refresh_objects(6)) <= left and TableId.bm25().key in left


def test_nothing_goes_before_the_trainer_announces_and_none_keeps_all(
        store: ObjectStore, bus: EventBus, filled: dict[str, int]) -> None:
    refreshes_built(bus)
    assert not RunRetention(bus, store, 1, 1).sweep_refreshes()  # no negatives.in_use yet
    bus.publish(TablesInUse(step=9, tables=(TableId.ann(6),), needed_from=6))
    fill(store, [k for s in (0, 2, 4, 6) for k in checkpoint_objects(s)])
    keep_all = RunRetention(bus, store, None, None)
    assert not keep_all.sweep_refreshes() and not keep_all.sweep_checkpoints()
    assert set(filled) <= set(store.list())
    assert complete_checkpoints(store.list(keys.CHECKPOINTS)) == [0, 2, 4, 6]


def test_a_finished_trainer_reads_nothing_more(store: ObjectStore, bus: EventBus,
                                               filled: dict[str, int]) -> None:
    refreshes_built(bus)
    bus.publish(TablesInUse(step=5, tables=(TableId.ann(2),), needed_from=2))
    bus.publish(RunFinished(step=6))
    sweep = RunRetention(bus, store, keep_refreshes=1, keep_checkpoints=None).sweep_refreshes()
    assert sorted(sweep.keys) == sorted(k for s in (0, 2, 4, 5) for k in refresh_objects(s))


def test_checkpoints_never_the_best_the_served_nor_one_in_flight(store: ObjectStore,
                                                                 bus: EventBus) -> None:
    # Complete checkpoints 0..8; 10 uploading (no MANIFEST); refreshes 0..6 evaluated, the best
    # on dev is 2; 8 is not evaluated yet (its refresh is in flight).
    names = [k for s in (0, 2, 4, 6, 8) for k in checkpoint_objects(s)]
    names += checkpoint_objects(10, complete=False)
    sizes = fill(store, names)
    refreshes_built(bus, dev={0: 0.2, 2: 0.5, 4: 0.3, 6: 0.4})
    sweep = RunRetention(bus, store, keep_refreshes=None, keep_checkpoints=1).sweep_checkpoints()
    gone = checkpoint_objects(0) + checkpoint_objects(4)
    assert sorted(sweep.keys) == sorted(gone)
    assert sweep.keys[0].endswith("MANIFEST.json")  # a half-deleted one never looks complete
    assert set(store.list()) == set(sizes) - set(gone)
    # 2: best on dev; 6: newest evaluated (Search encodes with it); 8: newest complete.
    assert complete_checkpoints(store.list(keys.CHECKPOINTS)) == [2, 6, 8]


def test_checkpoint_rules() -> None:
    stored = [k for s in (0, 3, 6, 9) for k in checkpoint_objects(s)]
    metrics = {0: {"dev": {"ndcg@10": 0.3}}, 3: {"dev": {"ndcg@10": 0.2}},
               6: {"dev": {"ndcg@10": 0.1}}}
    assert checkpoints_to_delete(stored, 1, metrics) == [3]
    assert checkpoints_to_delete(stored, 3, metrics) == []
    assert checkpoints_to_delete(stored, None, metrics) == []
    assert checkpoints_to_delete(stored, 1, {}) == []  # nothing evaluated: all in flight
    no_dev = {s: {"test": {"ndcg@10": 0.5}} for s in (0, 3, 6)}
    assert checkpoints_to_delete(stored, 1, no_dev) == [0, 3]
    # A tie on dev keeps the earlier of the two, the one `export --checkpoint best` picks
    # (protocol/selection.best_step), and lets the later go.
    tied = {0: {"dev": {"ndcg@10": 0.1}}, 3: {"dev": {"ndcg@10": 0.4}},
            6: {"dev": {"ndcg@10": 0.4}}, 9: {"dev": {"ndcg@10": 0.2}}}
    assert checkpoints_to_delete(stored, 1, tied) == [0, 6]
    assert best_step([DevPoint(s, m["dev"]["ndcg@10"]) for s, m in tied.items()]) == 3


def _table(step: int) -> NegativesTable:
    return NegativesTable(step=step, query_ids=np.array(["q1"]), candidates=np.array([[3, 4]]),
                          scores=np.zeros((1, 2), np.float32),
                          positive_scores=np.zeros(1, np.float32),
                          probabilities=np.full((1, 2), 0.5, np.float32),
                          sources=np.ones((1, 2), np.int8))


def test_the_trainer_announces_the_lowest_refresh_it_may_still_read(tmp_path: Path,
                                                                    bus: EventBus) -> None:
    """The feed on a real store and Redis: the floor follows the tables the loop holds and
    those the newest complete checkpoint holds (a resume reloads them)."""
    store = LocalStore(bus.run_id, tmp_path / "store")
    for step in (1, 3, 5):
        store.put_bytes(TableId.ann(step).key, _table(step).to_bytes())
    announced: Callable[[], list[int | None]] = lambda: [  # noqa: E731
        r.event.needed_from for r in bus.history(TablesInUse)]
    step = [0]
    feed = NegativesFeed(bus, store, "trainer", threading.Event(),
                         on_swap=lambda: tables.announce())
    tables = TablesAnnouncer(bus, feed, reads_refresh_tables=True, step=lambda: step[0])
    tables.checkpoint_saved(0, (None, None))
    tables.announce()
    assert announced() == [0]  # holds no table yet: every refresh may be needed
    tables.checkpoint_complete(0)
    feed._handle(NegativesReady(tables=(TableId.ann(1),)))
    assert announced() == [0, 1]
    step[0] = 10
    tables.checkpoint_saved(10, (1, None))
    tables.checkpoint_complete(10)  # newest complete holds table 1
    feed._handle(NegativesReady(tables=(TableId.ann(3),)))
    feed._handle(NegativesReady(tables=(TableId.ann(5),)))  # 3 and 5 ready, trainer moves on
    assert announced()[-1] == 1  # a resume from checkpoint 10 would reload table 1
    step[0] = 20
    tables.checkpoint_saved(20, (5, None))
    assert announced()[-1] == 1  # checkpoint 20 still uploading: 10 is the resume point
    tables.checkpoint_complete(20)
    assert announced()[-1] == 5
    last = list(bus.history(TablesInUse))[-1].event
    assert last.tables == (TableId.ann(5),) and last.step == 20
    n = len(announced())
    tables.announce()
    assert len(announced()) == n  # unchanged: not published again


def test_a_trainer_without_refresh_tables_needs_none(tmp_path: Path, bus: EventBus) -> None:
    feed = NegativesFeed(bus, LocalStore(bus.run_id, tmp_path / "s"), "t", threading.Event())
    TablesAnnouncer(bus, feed, reads_refresh_tables=False, step=lambda: 0).announce()
    assert [r.event.needed_from for r in bus.history(TablesInUse)] == [None]


def test_sizes_and_usage_come_from_one_listing(store: ObjectStore) -> None:
    sizes = fill(store, ["a/1.bin", "a/2.bin", "b/1.bin"])
    assert store.sizes() == sizes and store.sizes("a") == {k: sizes[k] for k in sizes
                                                           if k.startswith("a/")}
    assert store.usage() == sum(sizes.values()) and store.usage("nothing") == 0
    store.delete("a/1.bin")
    assert store.usage() == sizes["a/2.bin"] + sizes["b/1.bin"]


def test_status_reports_the_store_size() -> None:
    state = ServiceState(role="trainer", run_id="r", instance="t")
    server = GrpcServer(state).start()
    try:
        assert fetch_status(server.address).store_bytes == -1  # not listed yet
        state.update(store_bytes=123_456_789_012)
        assert fetch_status(server.address).store_bytes == 123_456_789_012
    finally:
        server.stop()

