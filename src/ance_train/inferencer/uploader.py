"""Pipelined upload: an encoded shard is stored, announced and acknowledged on one background
thread while the replica already encodes its next shard.

At most one shard is in flight: :meth:`ShardUploader.submit` first waits for the previous
upload, so memory stays bounded and events keep the order of encoding. The item's heartbeat
runs until its upload is done; an upload that fails (store or Redis unavailable) leaves the
item unacknowledged, so it is delivered again after ``claim_timeout_s``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ance_train.infra.bus import REDIS_UNAVAILABLE, EventBus, WorkItem, WorkQueue
from ance_train.infra.store import ObjectStore, StorageError
from ance_train.protocol.embeddings import EmbeddingDtype, pack_embeddings
from ance_train.protocol.events import ShardEncoded

log = logging.getLogger(__name__)


@dataclass
class EncodedShard:
    """A shard ready to upload: vectors, where its time went so far, and how to end its
    heartbeat."""

    item: WorkItem
    consumer: str
    ids: np.ndarray
    vectors: np.ndarray
    timings: dict[str, float] = field(default_factory=dict)  # load_s, encode_s, wait_s
    release: Callable[[], None] = lambda: None
    # The refresh timeline (``shard.encoded``'s ``claimed_at`` … ``encoded_at``, flags);
    # ``upload_started_at`` is added here.
    times: dict[str, float | bool] = field(default_factory=dict)
    passages: np.ndarray | None = None  # MaxP: each row's passage number (``ids``: its doc)


class ShardUploader:
    def __init__(self, store: ObjectStore, bus: EventBus, queue: WorkQueue,
                 on_uploaded: Callable[[EncodedShard, float], None],
                 dtype: EmbeddingDtype = "float16") -> None:
        self.store = store
        self.dtype = dtype  # inference.embedding_dtype: what the shard stores
        self.bus = bus
        self.queue = queue
        self.on_uploaded = on_uploaded  # (shard, seconds spent on it in all) after the ack
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="uploader")
        self._previous: Future | None = None

    def submit(self, shard: EncodedShard) -> None:
        """Queue ``shard`` for upload once the previous one is done (time waited: wait_s)."""
        started = time.monotonic()
        self.wait()
        shard.timings["wait_s"] = time.monotonic() - started
        self._previous = self._executor.submit(self._upload, shard)

    def wait(self) -> None:
        """Block until the shard in flight (if any) is uploaded or has failed."""
        if self._previous is not None:
            self._previous.result()
            self._previous = None

    def close(self) -> None:
        self.wait()
        self._executor.shutdown(wait=True)

    def _upload(self, shard: EncodedShard) -> None:
        item, timings = shard.item, shard.timings
        started = time.monotonic()
        shard.times["upload_started_at"] = time.time()
        try:
            key = item.key
            self.store.put_bytes(key, pack_embeddings(shard.ids, shard.vectors, self.dtype,
                                                         shard.passages))
            timings["upload_s"] = time.monotonic() - started
            seconds = timings.get("load_s", 0.0) + timings.get("encode_s", 0.0) + timings[
                "upload_s"]
            self.bus.publish(ShardEncoded(
                step=item.step, kind=item.kind, shard=item.shard, key=key,
                count=len(shard.ids), seconds=seconds, instance=shard.consumer,
                attempt=item.attempt, finished_at=time.time(), **shard.times,
                **{name: round(value, 4) for name, value in timings.items()}))
            self.queue.done(item)
        except (*REDIS_UNAVAILABLE, StorageError) as error:
            log.warning("%s@%d left for redelivery: upload failed: %s", item.name, item.step,
                        error)
            return
        finally:
            shard.release()
        self.on_uploaded(shard, seconds)
