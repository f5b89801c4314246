"""An inferencer replica killed while holding a shard: another replica reclaims and finishes it.

The dying replica is a separate OS process that claims the item through the real consumer
group and is then SIGKILLed; the survivor is a real inferencer service process.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from ance_train.infra.bus import EventBus, WorkQueue, connect
from ance_train.modeling.model import BiEncoder, load_tokenizer
from ance_train.protocol import keys
from ance_train.protocol.embeddings import unpack_embeddings
from ance_train.protocol.events import ShardEncoded
from ance_train.protocol.work import CORPUS, ShardWork

from ance_train_dev.fault_report import record_fault
from ance_train_dev.service_harness import Harness, stop, wait_until

pytestmark = pytest.mark.fault

CLAIM_AND_HANG = textwrap.dedent("""
    import sys, time
    from ance_train.infra.bus import EventBus, WorkQueue, connect
    bus = EventBus(connect(sys.argv[1]), sys.argv[2])
    queue = WorkQueue(bus, claim_timeout_s=float(sys.argv[3]))
    item = None
    while item is None:
        item = queue.claim("doomed-replica", block_ms=500)
    print(item.entry_id, item.shard, flush=True)
    time.sleep(600)
""")


def test_killed_replica_item_is_reclaimed_and_finished(tmp_path: Path, redis_server, tiny_model,
                                                       scifact_subset) -> None:
    timeout_s = 2.0
    harness = Harness.prepare(
        tmp_path, redis_server.url, run_id="reclaim",
        data={"path": str(scifact_subset)},
        model={"path": str(tiny_model), "max_doc_length": 32, "max_query_length": 16},
        inference={"shard_size": 1000, "claim_timeout_s": timeout_s, "torch_threads": 1},
    )
    config, store = harness.config, harness.store
    bus = EventBus(connect(redis_server.url), config.run_id)
    queue = WorkQueue(bus, timeout_s)

    # Checkpoint 0 in the store, one corpus shard queued, as the trainer would do.
    model = BiEncoder.from_pretrained(tiny_model, config.model)
    model.save(tmp_path / "ckpt", load_tokenizer(tiny_model))
    store.put_dir(keys.checkpoint(0), tmp_path / "ckpt")
    num_docs = len(validate_ids(harness))
    bus.set_latest_checkpoint(0)
    queue.enqueue([ShardWork(step=0, kind=CORPUS, shard=0, start=0, stop=num_docs)])

    doomed = subprocess.Popen([sys.executable, "-c", CLAIM_AND_HANG, redis_server.url,
                               config.run_id, str(timeout_s)], stdout=subprocess.PIPE, text=True)
    entry_id, shard = doomed.stdout.readline().split()
    assert queue.pending_count() == 1
    doomed.send_signal(signal.SIGKILL)
    doomed.wait()
    killed_ms = int(time.time() * 1000)

    survivor = harness.spawn("inferencer", "survivor")
    try:
        encoded = wait_until(lambda: list(bus.history(ShardEncoded)), 60,
                             "the surviving replica never finished the reclaimed shard")
    finally:
        stop(survivor)
    assert len(encoded) == 1
    event = encoded[0]
    assert event.event.instance == "survivor"
    assert event.event.attempt >= 2, "the item must have been re-delivered, not fresh"
    assert event.event.shard == int(shard) == 0
    assert queue.pending_count() == 0, "the reclaimed item must be acknowledged"
    ids, vectors = unpack_embeddings(store.get_bytes(keys.embedding_shard(0, CORPUS, 0)))
    np.testing.assert_array_equal(ids, np.arange(num_docs))
    assert vectors.shape == (num_docs, model.dim) and np.isfinite(vectors).all()
    assert entry_id  # the doomed replica really held an entry of the stream
    record_fault(
        "Inferencer replica killed holding a shard",
        "SIGKILL a replica process right after it claimed the only work item",
        f"a surviving replica reclaimed the item (XAUTOCLAIM after claim_timeout_s={timeout_s:g}) "
        f"on delivery {event.event.attempt}, encoded and acknowledged it (recovery time "
        "includes starting the surviving replica's process)",
        (int(event.entry_id.split("-")[0]) - killed_ms) / 1000, lost="nothing",
        claim_timeout_s=timeout_s)


def validate_ids(harness: Harness) -> list[str]:
    from ance_train.data.corpus import Corpus
    from ance_train.data.formats import DatasetFiles

    corpus = Corpus(DatasetFiles.resolve(harness.config.data), harness.root / "cache" /
                    "doc_offsets.npy", harness.config.data.format)
    return [corpus.doc_id(i) for i in range(len(corpus))]
