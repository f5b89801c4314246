"""Fault: the indexer is SIGKILLed in the middle of building checkpoint 0; a new one finishes it.

Trainer, inferencer and indexer run as OS processes (real Redis, local store). The trainer
waits for its first negatives, so the refresh of checkpoint 0 is what everything hangs on.
The window is wide by workload, not by a test hook: the whole SciFact corpus and an
evaluation depth covering it make the indexer evaluate for seconds, and the kill lands while
its gRPC Status reports that phase (negatives already written, nothing announced yet).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from ance_train.infra.bus import EventBus, connect
from ance_train.infra.rpc import fetch_status
from ance_train.protocol import keys
from ance_train.protocol.events import (
    CheckpointPublished,
    EvalCompleted,
    NegativesReady,
    ShardEncoded,
)
from ance_train.protocol.tables import TableId

from ance_train_dev.fault_report import record_fault
from ance_train_dev.helpers import scifact_dir
from ance_train_dev.service_harness import Harness, stop, wait_until

pytestmark = pytest.mark.fault


def _phase(bus: EventBus) -> str:
    address = bus.services().get("indexer:indexer")
    if address is None:
        return ""
    try:
        return fetch_status(address, timeout_s=1.0).progress.phase
    except Exception:  # not serving yet
        return ""


def _steps(bus: EventBus, event_type: str) -> list[int]:
    return [e.step for e in bus.history(event_type)]


def test_indexer_killed_mid_build_rebuilds_and_trainer_swaps(tmp_path: Path, redis_server,
                                                              tiny_model) -> None:
    harness = Harness.prepare(
        tmp_path, redis_server.url, run_id="indexer-restart",
        data={"path": str(scifact_dir()), "dev_fraction": 0.2},
        model={"path": str(tiny_model), "max_query_length": 16, "max_doc_length": 48},
        training={"steps": 4, "batch_size": 8, "refresh_every": 100, "torch_threads": 1},
        negatives={"pool": "ann", "per_query": 2, "warmup": "none", "top_k": 30},
        inference={"shard_size": 1000, "claim_timeout_s": 10, "torch_threads": 1},
        index={"eval_depth": 6000},
    )
    bus = EventBus(connect(redis_server.url), harness.config.run_id)
    store = harness.store
    first = harness.spawn("indexer", "indexer")
    processes = [first, harness.spawn("inferencer", "inferencer"),
                 harness.spawn("trainer", "trainer")]
    try:
        wait_until(lambda: _phase(bus) == "evaluating 0", 300,
                   "the indexer never reached the evaluation of checkpoint 0")
        first.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        first.wait()
        # Really mid-build: its negatives are written but nothing was announced.
        assert store.exists(TableId.ann(0).key)
        assert _steps(bus, NegativesReady) == []
        assert _steps(bus, EvalCompleted) == []
        plan_event = next(bus.history(CheckpointPublished))
        plan = plan_event.event.plan
        assert plan.expected_keys() <= set(store.list(keys.embeddings(0))), "shards missing"

        second = harness.spawn("indexer", "indexer-2")
        processes.append(second)
        wait_until(lambda: 0 in _steps(bus, NegativesReady), 300,
                   "the restarted indexer never published the negatives of checkpoint 0")
        recovery_s = time.monotonic() - killed_at
        trainer = processes[2]
        assert trainer.wait(timeout=300) == 0, harness.log("trainer")[-3000:]
    finally:
        for process in processes:
            stop(process)

    assert "recovered: last built checkpoint none, pending [0]" in harness.log("indexer-2")
    assert _steps(bus, NegativesReady).count(0) == 1
    assert _steps(bus, EvalCompleted).count(0) == 1
    assert store.get_json(keys.eval_report(0))["step"] == 0
    encoded = [(e.step, e.event.key) for e in bus.history(ShardEncoded)]
    zero = [key for step, key in encoded if step == 0]
    assert sorted(zero) == sorted(plan.expected_keys()), "a shard of 0 was encoded twice"
    for stream in (CheckpointPublished, ShardEncoded):
        pending = bus.client.xpending(bus.stream(stream), "indexer")["pending"]
        assert pending == 0, f"{stream}: entries left pending by the dead indexer"
    summary = store.get_json(keys.TRAINER_SUMMARY)
    assert summary["finished"]
    first_swap = summary["swaps"][0]  # (it also carries the swap's times: the timeline)
    assert (first_swap["step"], first_swap["negatives_step"]) == (1, 0), summary["swaps"]
    assert summary["negatives_steps"][0] == 0
    record_fault("indexer killed", "SIGKILL while evaluating checkpoint 0 (negatives written, "
                 "not announced)", "restarted indexer rebuilt checkpoint 0 from the stored "
                 "shards and announced it once; the trainer swapped to it", recovery_s,
                 lost="the interrupted build (redone); no shard re-encoded",
                 test="tests/test_indexer_restart.py")
