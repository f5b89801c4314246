"""Tests of the event bus and the shard work queue on a real Redis server (infra/bus.py)."""

from __future__ import annotations

import time

from ance_train.infra.bus import EventBus, WorkQueue, connect
from ance_train.protocol.events import NegativesReady, RunFinished
from ance_train.protocol.tables import TableId
from ance_train.protocol.work import ShardKind, ShardWork

EVENT = RunFinished


def _publish(bus: EventBus, steps: range) -> list[str]:
    return [bus.publish(RunFinished(step=step)) for step in steps]


def _work(step: int, kind: str, ranges: list[tuple[int, int]]) -> list[ShardWork]:
    return [ShardWork(step=step, kind=ShardKind(kind), shard=shard, start=start, stop=stop)
            for shard, (start, stop) in enumerate(ranges)]


def test_publish_consume_once_per_group_and_every_group(bus: EventBus) -> None:
    ids = _publish(bus, range(5))
    first = bus.consume(EVENT, "indexer", "i-0", block_ms=100)
    assert [e.entry_id for e in first] == ids
    assert [e.step for e in first] == [0, 1, 2, 3, 4]
    assert first[2].event == RunFinished(run_id="test-run", step=2)
    for event in first:
        bus.ack(EVENT, "indexer", event.entry_id)
    assert bus.consume(EVENT, "indexer", "i-0", block_ms=100) == []

    # A second group gets every event too, split between its two consumers without overlap.
    a = bus.consume(EVENT, "launcher", "a", block_ms=100, count=3)
    b = bus.consume(EVENT, "launcher", "b", block_ms=100, count=3)
    assert len(a) == 3 and len(b) == 2
    assert sorted(e.entry_id for e in a + b) == ids
    for event in a:
        bus.ack(EVENT, "launcher", event.entry_id)
    for event in b:
        bus.ack(EVENT, "launcher", event.entry_id)
    assert bus.consume(EVENT, "launcher", "a", block_ms=100) == []
    assert bus.consume(EVENT, "launcher", "b", block_ms=100) == []

    # A new event reaches each group once.
    (new_id,) = _publish(bus, range(5, 6))
    assert [e.entry_id for e in bus.consume(EVENT, "indexer", "i-0", block_ms=100)] == [new_id]
    got = bus.consume(EVENT, "launcher", "b", block_ms=100)
    assert [e.entry_id for e in got] == [new_id]
    assert bus.consume(EVENT, "launcher", "a", block_ms=100) == []


def test_unacked_events_are_redelivered_after_restart(bus: EventBus, redis_server) -> None:
    ids = _publish(bus, range(3))
    got = bus.consume(EVENT, "trainer", "t-0", block_ms=100)
    assert [e.entry_id for e in got] == ids
    bus.ack(EVENT, "trainer", ids[0])
    # "Restart": a new client and bus, the same consumer name.
    restarted = EventBus(connect(redis_server.url), "test-run")
    again = restarted.consume(EVENT, "trainer", "t-0", block_ms=100)
    assert [e.entry_id for e in again] == ids[1:]
    assert [e.step for e in again] == [1, 2]
    # Still pending until acknowledged: delivered once more, then never after the ack.
    assert [e.entry_id for e in restarted.consume(EVENT, "trainer", "t-0", block_ms=100)] == \
        ids[1:]
    for entry_id in ids[1:]:
        restarted.ack(EVENT, "trainer", entry_id)
    assert restarted.consume(EVENT, "trainer", "t-0", block_ms=100) == []
    # Pending redelivery comes before fresh events.
    (fresh,) = _publish(bus, range(3, 4))
    assert [e.entry_id for e in restarted.consume(EVENT, "trainer", "t-0", block_ms=100)] == \
        [fresh]


def test_consume_blocks_at_most_block_ms(bus: EventBus) -> None:
    started = time.monotonic()
    assert bus.consume(EVENT, "g", "c", block_ms=200) == []
    elapsed = time.monotonic() - started
    assert 0.15 <= elapsed < 2.0


def test_read_all_with_cursor(bus: EventBus) -> None:
    assert bus.read_all(EVENT) == []
    first = _publish(bus, range(3))
    seen = bus.read_all(EVENT)
    assert [e.entry_id for e in seen] == first
    cursor = seen[-1].entry_id
    assert bus.read_all(EVENT, after=cursor) == []
    second = _publish(bus, range(3, 5))
    later = bus.read_all(EVENT, after=cursor)
    assert [e.entry_id for e in later] == second
    assert [e.step for e in later] == [3, 4]
    # Reading with a group elsewhere does not affect group-less reads.
    bus.consume(EVENT, "other", "x", block_ms=100)
    assert [e.entry_id for e in bus.read_all(EVENT)] == first + second
    assert [e.entry_id for e in bus.read_all(EVENT, count=2)] == first[:2]
    assert [e.entry_id for e in bus.history(EVENT)] == first + second


def test_streams_are_per_run_and_per_type(bus: EventBus, redis_server) -> None:
    other_run = EventBus(connect(redis_server.url), "other-run")
    _publish(bus, range(2))
    other_run.publish(RunFinished(step=9))
    bus.publish(NegativesReady(tables=(TableId.ann(4),)))
    assert [e.step for e in bus.read_all(EVENT)] == [0, 1]
    assert [e.step for e in other_run.read_all(EVENT)] == [9]
    assert [e.step for e in bus.read_all(NegativesReady)] == [4]


RANGES = [(0, 10), (10, 20), (20, 30), (30, 35)]


def test_work_queue_consumers_claim_disjoint_items(bus: EventBus) -> None:
    queue = WorkQueue(bus, claim_timeout_s=30)
    queue.enqueue(_work(4, "corpus", RANGES))
    claimed = {"r0": [], "r1": []}
    while True:
        progressed = False
        for consumer in claimed:
            item = queue.claim(consumer, block_ms=0)
            if item is not None:
                claimed[consumer].append(item)
                progressed = True
        if not progressed:
            break
    assert len(claimed["r0"]) == 2 and len(claimed["r1"]) == 2
    items = claimed["r0"] + claimed["r1"]
    assert len({i.entry_id for i in items}) == 4
    assert sorted((i.shard, i.start, i.stop) for i in items) == [
        (s, a, b) for s, (a, b) in enumerate(RANGES)
    ]
    assert all(i.step == 4 and i.kind == "corpus" and i.attempt == 1 for i in items)
    assert sorted(i.name for i in items) == [f"corpus-{s:05d}" for s in range(4)]
    assert queue.pending_count() == 4
    for item in items:
        queue.done(item)
    assert queue.pending_count() == 0
    assert queue.claim("r0", block_ms=0) is None


def test_silent_item_is_reclaimed_and_heartbeaten_item_is_not(bus: EventBus) -> None:
    queue = WorkQueue(bus, claim_timeout_s=0.3)
    queue.enqueue(_work(8, "queries", [(0, 5)]))
    item = queue.claim("alive", block_ms=0)
    assert item is not None and item.attempt == 1
    # Heart-beaten every 0.1 s for 1 s: never reclaimed.
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        time.sleep(0.1)
        assert queue.claim("thief", block_ms=0) is None
        queue.heartbeat("alive", item)
    # Silent for longer than claim_timeout: another consumer takes it over.
    time.sleep(0.45)
    taken = queue.claim("thief", block_ms=0)
    assert taken is not None
    assert taken.entry_id == item.entry_id
    assert (taken.step, taken.kind, taken.shard, taken.start, taken.stop) == (8, "queries", 0,
                                                                             0, 5)
    assert taken.attempt == 2
    assert queue.pending_count() == 1
    # And once more after another silence: the attempt counts deliveries.
    time.sleep(0.45)
    third = queue.claim("rescuer", block_ms=0)
    assert third is not None and third.entry_id == item.entry_id
    assert third.attempt == 3
    queue.done(third)
    assert queue.pending_count() == 0
    time.sleep(0.45)
    assert queue.claim("thief", block_ms=0) is None


def test_silent_item_is_reclaimed_behind_many_live_items(bus: EventBus) -> None:
    """With 12 replicas at work, a dead replica's item is still taken over before new work.

    The live items were claimed first, so they sit ahead of the dead one in the pending list.
    """
    queue = WorkQueue(bus, claim_timeout_s=0.3)
    queue.enqueue(_work(2, "corpus", [(i, i + 1) for i in range(14)]))
    live = [queue.claim(f"live-{i}", block_ms=0) for i in range(12)]
    assert all(item is not None for item in live)
    dead = queue.claim("dead", block_ms=0)
    assert dead is not None and dead.shard == 12
    for _ in range(5):  # 0.5 s: the live replicas heartbeat, the dead one is silent
        time.sleep(0.1)
        for i, item in enumerate(live):
            queue.heartbeat(f"live-{i}", item)
    taken = queue.claim("rescuer", block_ms=0)
    assert taken is not None
    assert (taken.entry_id, taken.shard, taken.attempt) == (dead.entry_id, 12, 2)


def test_done_item_is_not_reclaimed(bus: EventBus) -> None:
    queue = WorkQueue(bus, claim_timeout_s=0.3)
    queue.enqueue(_work(1, "corpus", [(0, 3), (3, 6)]))
    first = queue.claim("r0", block_ms=0)
    second = queue.claim("r0", block_ms=0)
    assert first is not None and second is not None
    queue.done(first)
    assert queue.pending_count() == 1
    time.sleep(0.45)
    reclaimed = queue.claim("r1", block_ms=0)
    assert reclaimed is not None and reclaimed.entry_id == second.entry_id
    assert queue.claim("r1", block_ms=0) is None


def test_service_registry_with_ttl(bus: EventBus) -> None:
    assert bus.services() == {}
    bus.register("indexer", "0", "127.0.0.1:5001", ttl_s=1)
    bus.register("inferencer", "1", "127.0.0.1:5003", ttl_s=30)
    assert bus.services() == {"indexer:0": "127.0.0.1:5001", "inferencer:1": "127.0.0.1:5003"}
    assert 0 < bus.client.ttl(bus.key("service:indexer:0")) <= 1
    time.sleep(1.3)
    assert bus.services() == {"inferencer:1": "127.0.0.1:5003"}
    # Re-registering refreshes the entry.
    bus.register("inferencer", "1", "127.0.0.1:6000", ttl_s=30)
    assert bus.services() == {"inferencer:1": "127.0.0.1:6000"}


def test_latest_checkpoint(bus: EventBus) -> None:
    assert bus.latest_checkpoint() == -1
    bus.set_latest_checkpoint(0)
    assert bus.latest_checkpoint() == 0
    bus.set_latest_checkpoint(300)
    assert bus.latest_checkpoint() == 300
