"""Scaling the inferencers while a run is in progress (what `kubectl scale` does in the cluster).

Trainer, indexer and one inferencer run as OS processes (real Redis, local store). After the
first refresh a second inferencer process is started — a new pod of the Deployment — without
touching the others. The new replica must take shards from the next refresh on (it joins the
consumer group, nothing is reconfigured), the first replica and the trainer must keep running
(nothing restarted), and every shard of every refresh must be encoded exactly once.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ance_train.infra.bus import EventBus, connect
from ance_train.protocol.events import NegativesReady, ShardEncoded

from ance_train_dev.service_harness import Harness, stop, wait_until


def _refreshed(bus: EventBus) -> list[int]:
    return [e.step for e in bus.history(NegativesReady) if e.step is not None]


def test_added_replica_takes_shards_from_the_next_refresh(tmp_path: Path, redis_server,
                                                          tiny_model, scifact_subset) -> None:
    harness = Harness.prepare(
        tmp_path, redis_server.url, run_id="scale",
        data={"path": str(scifact_subset), "dev_fraction": 0.2},
        model={"path": str(tiny_model), "max_query_length": 16, "max_doc_length": 48},
        training={"steps": 1000, "batch_size": 8, "refresh_every": 15, "torch_threads": 1},
        negatives={"pool": "ann", "per_query": 1, "warmup": "none", "top_k": 30},
        inference={"shard_size": 50, "claim_timeout_s": 30, "torch_threads": 1},
        index={"eval_depth": 100},
    )
    bus = EventBus(connect(redis_server.url), harness.config.run_id)
    processes = {"indexer": harness.spawn("indexer", "indexer"),
                 "inf-a": harness.spawn("inferencer", "inf-a"),
                 "trainer": harness.spawn("trainer", "trainer")}
    try:
        wait_until(lambda: 0 in _refreshed(bus), 300, "the first refresh never completed")
        processes["inf-b"] = harness.spawn("inferencer", "inf-b")  # the scaled-up pod
        joined = wait_until(
            lambda: next((e.step for e in bus.history(ShardEncoded)
                          if e.event.instance == "inf-b"), None), 300,
            "the added replica never took a shard")
        wait_until(lambda: max(_refreshed(bus)) > joined, 300,
                   "no refresh completed after the added replica joined")
        for name, process in processes.items():
            assert process.poll() is None, harness.log(name)  # nothing restarted or exited
        encoded = list(bus.history(ShardEncoded))
        refreshed = _refreshed(bus)
    finally:
        for process in processes.values():
            stop(process)

    assert joined > 0, "inf-b started after refresh 0 was complete"
    keys = Counter((e.step, e.event.key) for e in encoded)
    assert max(keys.values()) == 1, "a shard was encoded twice"
    shards_per_refresh = Counter(step for step, _ in keys)
    complete = {shards_per_refresh[step] for step in refreshed}
    assert complete == {shards_per_refresh[0]}, f"incomplete refresh: {shards_per_refresh}"
    assert {e.event.instance for e in encoded if e.step >= joined} == {"inf-a", "inf-b"}
    assert "resuming" not in harness.log("trainer")
