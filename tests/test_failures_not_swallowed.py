"""Consumer loops survive Redis being unavailable, and only that: any other error (a bug, a
payload a handler cannot take) stops the service with the error.

These are tests about the loops' logic, so the bus is an in-memory fake (``ScriptedBus``);
the store, dataset, model and config are real. That a malformed event is dead-lettered by
the real bus on a real Redis server is tested in tests/test_protocol.py, and that a service
process that dies stops an embedded run in tests/test_launcher.py.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from ance_train.config import load_config
from ance_train.data.corpus import open_corpus
from ance_train.data.validation import validate_dataset
from ance_train.indexer.indexer import Indexer
from ance_train.infra.bus import Received
from ance_train.infra.store import LocalStore
from ance_train.negatives.table import NegativesTable
from ance_train.protocol.events import CheckpointPublished, NegativesReady
from ance_train.protocol.tables import TableId
from ance_train.protocol.work import RefreshPlan
from ance_train.runtime import ServiceContext, ServiceOptions
from ance_train.trainer.negatives_feed import NegativesFeed

from ance_train_dev.helpers import write_config


class ScriptedBus:
    """Fake of :class:`EventBus` for logic tests: ``consume`` plays a script of actions, each
    returning entries or raising; every call after the script sets ``stop``."""

    def __init__(self, run_id: str, script: list[Callable[[], list]], stop: threading.Event):
        self.run_id = run_id
        self.script = list(script)
        self.stop = stop
        self.acked: list[str] = []
        self.consumed = 0

    def consume(self, event_type, group, consumer, block_ms=1000, count=16) -> list:
        self.consumed += 1
        if not self.script:
            self.stop.set()
            return []
        return self.script.pop(0)()

    def ack(self, event_type, group, entry_id) -> None:
        self.acked.append(entry_id)

    def history(self, event_type):
        return iter(())

    def stream(self, event_type) -> str:
        return f"ance:{self.run_id}:{event_type.TYPE}"


def _redis_down() -> list:
    raise redis.ConnectionError("Redis is restarting")


def _bug() -> list:
    raise ZeroDivisionError("a bug in the handler")


@pytest.fixture
def context(tmp_path: Path, scifact_subset: Path, tiny_model: Path):
    """A real config, dataset, corpus and local store; the bus is set by each test."""
    config_path = write_config(
        tmp_path / "run.yaml", run_id="failures", data={"path": str(scifact_subset)},
        model={"path": str(tiny_model), "max_doc_length": 32},
        negatives={"pool": "ann", "warmup": "none"}, index={"eval_splits": ["dev"]})
    config = load_config(config_path)
    dataset = validate_dataset(config.data, tmp_path / "cache")

    def build(script: list[Callable[[], list]]) -> ServiceContext:
        stop = threading.Event()
        ctx = ServiceContext(
            options=ServiceOptions(role="indexer", config_path=str(config_path),
                                   redis_url="redis://unused", work_dir=str(tmp_path / "work"),
                                   instance="indexer"),
            config=config, log=logging.getLogger("test.failures"),
            work_dir=tmp_path / "work", store=LocalStore(config.run_id, tmp_path / "store"),
            redis=None, bus=ScriptedBus(config.run_id, script, stop),  # type: ignore[arg-type]
            dataset=dataset, corpus=open_corpus(config.data, tmp_path / "cache"), stop=stop)
        return ctx

    return build


def _published(step: int) -> list:
    plan = RefreshPlan(step=step, corpus_ranges=((0, 10),), query_ranges=((0, 5),))
    return [Received(f"{step}-0", CheckpointPublished(step=step, key=f"checkpoints/{step}",
                                                      plan=plan))]


def test_indexer_loop_backs_off_while_redis_is_unavailable(context, caplog) -> None:
    ctx = context([_redis_down, _redis_down, lambda: _published(4)])
    indexer = Indexer(ctx)
    with caplog.at_level(logging.WARNING):
        indexer.run()  # returns when the script is over (stop is set)
    assert caplog.text.count("reading events failed: Redis is restarting") == 2
    assert 4 in indexer.plans, "after the outage the loop went on and handled the event"


def test_a_bug_in_an_indexer_handler_stops_the_service_with_the_error(context, caplog,
                                                                      monkeypatch) -> None:
    ctx = context([lambda: _published(4)] + [lambda: []] * 5)

    def broken_handler(self, received) -> None:
        raise KeyError("a bug in _add_plan")

    monkeypatch.setattr(Indexer, "_add_plan", broken_handler)
    indexer = Indexer(ctx)
    with pytest.raises(KeyError, match="a bug in _add_plan"):
        indexer.run()
    assert ctx.bus.acked == [], "the event it could not handle stays pending for a restart"
    # As a service: the error is logged, reported, and the process exits with code 1.
    ctx = context([lambda: _published(4)])
    with caplog.at_level(logging.ERROR):
        assert ctx.run(lambda c: Indexer(c).run() or 0) == 1
    assert "indexer failed" in caplog.text and "a bug in _add_plan" in caplog.text


def test_negatives_feed_retries_redis_and_hands_a_bug_to_the_training_loop(
        context, tmp_path: Path) -> None:
    store = LocalStore("failures", tmp_path / "feed-store")
    table = NegativesTable.from_bytes(_bm25_table().to_bytes())
    store.put_bytes(TableId.bm25().key, table.to_bytes())
    ready = [Received("1-0", NegativesReady(tables=(TableId.bm25(),)))]
    stop = threading.Event()
    bus = ScriptedBus("failures", [_redis_down, lambda: ready, _bug], stop)
    feed = NegativesFeed(bus, store, "trainer", stop).start()  # type: ignore[arg-type]
    assert feed.wait_until(lambda: feed.error is not None, timeout_s=30)
    assert feed.bm25 is not None and bus.acked == ["1-0"], "handled after the Redis outage"
    with pytest.raises(RuntimeError, match="the negatives feed stopped") as raised:
        feed.check()
    assert isinstance(raised.value.__cause__, ZeroDivisionError)


def test_feed_check_is_silent_while_all_is_well(tmp_path: Path) -> None:
    stop = threading.Event()
    feed = NegativesFeed(ScriptedBus("r", [_redis_down], stop),  # type: ignore[arg-type]
                         LocalStore("r", tmp_path / "s"), "trainer", stop).start()
    stop.wait(10)
    feed.check()  # a Redis outage is not an error of the feed
    assert feed.error is None


def _bm25_table() -> NegativesTable:
    import numpy as np

    return NegativesTable(step=-1, query_ids=np.array(["q1"]), candidates=np.array([[3, 4]]),
                          scores=np.zeros((1, 2), np.float32),
                          positive_scores=np.zeros(1, np.float32),
                          probabilities=np.full((1, 2), 0.5, np.float32),
                          sources=np.ones((1, 2), np.int8))
