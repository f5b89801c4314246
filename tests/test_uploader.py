"""Pipelined upload (src/ance_train/inferencer/uploader.py): real Redis, real local store."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from ance_train.inferencer.uploader import EncodedShard, ShardUploader
from ance_train.infra.bus import EventBus, WorkItem, WorkQueue
from ance_train.infra.store import LocalStore, StorageError
from ance_train.protocol import keys
from ance_train.protocol.embeddings import stored_dtype, unpack_embeddings
from ance_train.protocol.events import ShardEncoded
from ance_train.protocol.work import CORPUS, ShardWork

STEP = 3


class GatedStore(LocalStore):
    """A local store whose uploads wait for ``gate`` (so an upload can be caught in flight)."""

    def __init__(self, run_id: str, root: Path) -> None:
        super().__init__(run_id, root)
        self.gate = threading.Event()
        self.started = threading.Event()

    def put_bytes(self, key: str, data: bytes) -> str:
        self.started.set()
        assert self.gate.wait(10), "test never opened the gate"
        return super().put_bytes(key, data)


class BrokenStore(LocalStore):
    def put_bytes(self, key: str, data: bytes) -> str:
        raise StorageError("store unavailable")


def claimed_items(bus: EventBus, count: int) -> tuple[WorkQueue, list]:
    queue = WorkQueue(bus, claim_timeout_s=30)
    queue.enqueue([ShardWork(step=STEP, kind=CORPUS, shard=i, start=2 * i, stop=2 * i + 2)
                   for i in range(count)])
    return queue, [queue.claim("replica", block_ms=1000) for _ in range(count)]


def shard(item: WorkItem, released: list[int]) -> EncodedShard:
    ids = np.arange(item.start, item.stop, dtype=np.int64)
    vectors = np.full((len(ids), 4), float(item.shard), dtype=np.float32)
    return EncodedShard(item, "replica", ids, vectors, {"load_s": 0.25, "encode_s": 1.5},
                        lambda: released.append(item.shard))


def test_upload_runs_while_the_next_shard_is_encoded(tmp_path: Path, bus) -> None:
    store = GatedStore(bus.run_id, tmp_path / "store")
    queue, items = claimed_items(bus, 2)
    released: list[int] = []
    uploaded: list[tuple[int, float]] = []
    uploader = ShardUploader(store, bus, queue, lambda s, sec: uploaded.append((s.item.shard, sec)))

    uploader.submit(shard(items[0], released))  # returns while the upload is held
    assert store.started.wait(5)
    assert released == [] and queue.pending_count() == 2  # heartbeat on, not acknowledged
    # The next shard waits for the one in flight (one upload at a time, in order).
    second = threading.Thread(target=uploader.submit, args=(shard(items[1], released),))
    second.start()
    second.join(0.5)
    assert second.is_alive()
    store.gate.set()
    second.join(10)
    uploader.close()

    published = list(bus.history(ShardEncoded))
    assert [e.event.shard for e in published] == [0, 1]
    for event in published:
        p = event.event.model_dump()
        assert p["count"] == 2 and p["key"] == keys.embedding_shard(STEP, CORPUS, p["shard"])
        assert p["load_s"] == 0.25 and p["encode_s"] == 1.5 and p["upload_s"] >= 0
        assert p["seconds"] == pytest.approx(0.25 + 1.5 + p["upload_s"], abs=1e-3)
        assert "wait_s" in p and p["finished_at"] > 0
    assert published[1].event.wait_s >= 0.4  # it really waited for the first upload
    assert queue.pending_count() == 0
    assert released == [0, 1] and [s for s, _ in uploaded] == [0, 1]
    ids, vectors = unpack_embeddings(store.get_bytes(keys.embedding_shard(STEP, CORPUS, 1)))
    assert ids.tolist() == [2, 3] and np.all(vectors == 1.0)


def test_failed_upload_leaves_the_item_for_redelivery(tmp_path: Path, bus) -> None:
    queue, items = claimed_items(bus, 1)
    released: list[int] = []
    uploaded: list[int] = []
    uploader = ShardUploader(BrokenStore(bus.run_id, tmp_path / "store"), bus, queue,
                             lambda s, sec: uploaded.append(s.item.shard))
    uploader.submit(shard(items[0], released))
    uploader.close()
    assert released == [0]  # the heartbeat stops, so another replica can reclaim it
    assert queue.pending_count() == 1 and uploaded == []
    assert list(bus.history(ShardEncoded)) == []


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_the_shard_is_stored_in_the_configured_dtype(tmp_path: Path, bus, dtype: str) -> None:
    queue, items = claimed_items(bus, 1)
    store = LocalStore(bus.run_id, tmp_path / "store")
    uploader = ShardUploader(store, bus, queue, lambda s, sec: None, dtype)
    uploader.submit(shard(items[0], []))
    uploader.close()
    data = store.get_bytes(keys.embedding_shard(STEP, CORPUS, 0))
    assert stored_dtype(data) == np.dtype(dtype)
    assert unpack_embeddings(data)[1].dtype == np.float32
