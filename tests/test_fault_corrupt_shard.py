"""A truncated embedding shard in the store is detected by its sha256 and never indexed.

Trainer and two inferencers (OS processes) encode every shard of checkpoint 0 while the
indexer is not running yet; one uploaded corpus shard is then truncated in place on disk (its
recorded sha256 stays). The indexer, started next, must detect the mismatch naming the key,
refuse to build on it, have the shard encoded again, and only then build, mine and evaluate.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ance_train.infra.bus import EventBus, connect
from ance_train.infra.store import CorruptObject
from ance_train.protocol import keys
from ance_train.protocol.embeddings import unpack_embeddings
from ance_train.protocol.events import EvalCompleted, NegativesReady, ShardEncoded
from ance_train.protocol.work import CORPUS, ShardWork

from ance_train_dev.fault_report import record_fault
from ance_train_dev.fault_run import (
    ServiceRun,
    assert_nothing_lost,
    entry_ms,
    refresh_plan,
    run_sections,
    shards_encoded,
)
from ance_train_dev.service_harness import Harness, wait_until

pytestmark = pytest.mark.fault

SHARD = 3


def test_truncated_shard_is_detected_and_encoded_again(tmp_path: Path, redis_server, tiny_model,
                                                       scifact_subset) -> None:
    harness = Harness.prepare(tmp_path, redis_server.url,
                              **run_sections("corrupt-shard", scifact_subset, tiny_model))
    store, steps = harness.store, harness.config.training.steps
    bus = EventBus(connect(redis_server.url), harness.config.run_id)
    key = keys.embedding_shard(0, CORPUS, SHARD)
    run = ServiceRun.start(harness, indexer=False)
    try:
        plan = wait_until(lambda: refresh_plan(bus, 0), 120, "checkpoint 0 not published")
        total = len(plan.expected_keys())
        wait_until(lambda: shards_encoded(bus, 0) == total, 120, "checkpoint 0 not encoded")
        path = tmp_path / "store" / harness.config.run_id / key
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])  # truncated after upload; sha256 unchanged
        with pytest.raises(CorruptObject, match="corrupt"):
            store.get_bytes(key)

        run.spawn("indexer", "indexer")
        run.wait_finished(bus, timeout_s=240)
        counts = assert_nothing_lost(harness, bus, encoded_again={(0, CORPUS, SHARD)})
        run.assert_alive()
    finally:
        run.stop()

    log = harness.log("indexer")
    assert f"object '{key}' is corrupt: sha256 " in log
    assert f"checkpoint 0 waits for {key} to be encoded again" in log
    encodes = [e for e in bus.history(ShardEncoded)
               if (e.step, e.event.kind, e.event.shard) == (0, CORPUS, SHARD)]
    assert len(encodes) == 2, "the truncated shard must be encoded exactly once more"
    items = [(entry_id, json.loads(fields["data"]))
             for entry_id, fields in bus.client.xrange(bus.stream(ShardWork))]
    requeued = [entry_id for entry_id, item in items
                if (item["step"], item["kind"], item["shard"]) == (0, CORPUS, SHARD)]
    assert len(requeued) == 2
    ready = [e for e in bus.history(NegativesReady) if e.step == 0]
    # One index of checkpoint 0, built only after the good copy was back.
    assert len(ready) == 1 and ready[0].entry_id > encodes[1].entry_id
    ids, vectors = unpack_embeddings(store.get_bytes(key))
    start, stop = plan.corpus_ranges[SHARD]
    np.testing.assert_array_equal(ids, np.arange(start, stop))
    assert np.isfinite(vectors).all()
    assert any(e.step == steps for e in bus.history(EvalCompleted))

    recovery_s = (entry_ms(ready[0].entry_id) - entry_ms(requeued[1])) / 1000
    record_fault(
        "Truncated embedding shard",
        f"{key} truncated to half its bytes on disk after upload (recorded sha256 kept)",
        "indexer: sha256 mismatch naming the key; shard deleted and queued again, re-encoded "
        "by a replica; checkpoint 0 indexed once, on the good copy; run completed",
        recovery_s, lost="nothing (one shard encoded twice)", **counts)
