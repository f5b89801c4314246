"""Fault: duplicate and stale events published into a running system change nothing.

Trainer, inferencer and indexer run as OS processes (real Redis, local store) and keep
refreshing. Once checkpoint k > 0 is built, the test re-publishes, as a faulty or replaying
producer would: a duplicate ``shard.encoded`` and a duplicate ``checkpoint.published`` of k,
plus a late ``shard.encoded`` and ``checkpoint.published`` of checkpoint 0, long superseded.
It waits until the indexer has read them and has built a checkpoint newer than k (so it went
on past them), then checks that the outputs of 0 and k are byte-identical, announced once,
and that no shard was encoded because of the injected events.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from ance_train.infra.bus import EventBus, connect
from ance_train.protocol import keys
from ance_train.protocol.events import (
    CheckpointPublished,
    EvalCompleted,
    Event,
    NegativesReady,
    ShardEncoded,
)
from ance_train.protocol.tables import TableId
from ance_train.protocol.work import ShardWork

from ance_train_dev.fault_report import record_fault
from ance_train_dev.service_harness import Harness, stop, wait_until

pytestmark = pytest.mark.fault

GROUP = "indexer"


def _built(bus: EventBus) -> list[int]:
    return [e.step for e in bus.history(NegativesReady) if e.step is not None]


def _replay(bus: EventBus, event_type: type[Event], step: int) -> str:
    """Publish again the first real event of ``event_type`` for ``step``."""
    original = next(e for e in bus.history(event_type) if e.step == step)
    return bus.publish(original.event)


def _read_past(bus: EventBus, event_type: type[Event], entry_id: str) -> bool:
    """Whether the indexer's group has been delivered ``entry_id`` and acknowledged it."""
    group = next(g for g in bus.client.xinfo_groups(bus.stream(event_type)) if g["name"] == GROUP)
    delivered = tuple(int(p) for p in group["last-delivered-id"].split("-"))
    return delivered >= tuple(int(p) for p in entry_id.split("-")) and group["pending"] == 0


def _encoded(bus: EventBus, steps: set[int], exclude: set[str]) -> list[tuple[int, str]]:
    return sorted((e.step, e.event.key) for e in bus.history(ShardEncoded)
                  if e.step in steps and e.entry_id not in exclude)


def _artefacts(harness: Harness, steps: list[int]) -> dict[str, str]:
    names = [TableId.ann(s).key for s in steps] + [keys.eval_report(s) for s in steps]
    return {key: hashlib.sha256(harness.store.get_bytes(key)).hexdigest() for key in names}


def test_duplicate_and_stale_events_change_nothing(tmp_path: Path, redis_server, tiny_model,
                                                   scifact_subset) -> None:
    harness = Harness.prepare(
        tmp_path, redis_server.url, run_id="duplicates",
        data={"path": str(scifact_subset), "dev_fraction": 0.2},
        model={"path": str(tiny_model), "max_query_length": 16, "max_doc_length": 48},
        training={"steps": 1000, "batch_size": 8, "refresh_every": 15, "torch_threads": 1},
        negatives={"pool": "ann", "per_query": 2, "warmup": "none", "top_k": 30},
        inference={"shard_size": 100, "claim_timeout_s": 10, "torch_threads": 1},
        index={"eval_depth": 100},
    )
    bus = EventBus(connect(redis_server.url), harness.config.run_id)
    processes = [harness.spawn("indexer", "indexer"), harness.spawn("inferencer", "inferencer"),
                 harness.spawn("trainer", "trainer")]
    try:
        k = wait_until(lambda: max((s for s in _built(bus) if s > 0), default=0), 300,
                       "no checkpoint after 0 was ever indexed")
        steps = [0, k]
        before = _artefacts(harness, steps)
        encoded_before = _encoded(bus, set(steps), exclude=set())
        work_before = bus.client.xlen(bus.stream(ShardWork))
        injected = {
            ShardEncoded: [_replay(bus, ShardEncoded, k),
                                   _replay(bus, ShardEncoded, 0)],
            CheckpointPublished: [_replay(bus, CheckpointPublished, k),
                                          _replay(bus, CheckpointPublished, 0)],
        }
        injected_at = time.monotonic()
        wait_until(lambda: all(_read_past(bus, t, ids[-1]) for t, ids in injected.items()),
                   60, "the indexer never read the injected events")
        # A newer build shows the indexer's loop went on past the injected events.
        wait_until(lambda: max(_built(bus)) > k, 300, "no newer checkpoint was indexed")
        settled_s = time.monotonic() - injected_at
        work_queued = bus.client.xrange(bus.stream(ShardWork))
    finally:
        for process in processes:
            stop(process)

    assert _artefacts(harness, steps) == before, "negatives or eval files were rewritten"
    built = _built(bus)
    evaluated = [e.step for e in bus.history(EvalCompleted)]
    for step in steps:
        assert built.count(step) == 1, f"negatives.ready of {step} published again"
        assert evaluated.count(step) == 1, f"eval.completed of {step} published again"
    exclude = {entry for ids in injected.values() for entry in ids}
    assert _encoded(bus, set(steps), exclude) == encoded_before, "a shard was encoded again"
    assert len(work_queued) >= work_before
    requeued = [entry for entry, fields in work_queued[work_before:]
                if json.loads(fields["data"])["step"] in steps]
    assert requeued == [], "work was queued again for an old checkpoint"
    record_fault("duplicate and stale events", f"re-published shard.encoded and "
                 f"checkpoint.published of built checkpoint {k} and of superseded checkpoint 0",
                 "ignored: outputs of 0 and k byte-identical, announced once, nothing "
                 "re-encoded or re-queued", None, settled_s=round(settled_s, 2),
                 test="tests/test_duplicate_events.py")
