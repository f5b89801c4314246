"""The Inferencer service: claims shard work items, encodes them, uploads the embeddings.

Replicas share one consumer group, so each item goes to one live replica; a replica keeps
its claim alive with heartbeats while encoding, and an item whose replica died is reclaimed
by another one after ``inference.claim_timeout_s``.

Supersession: an item is encoded only if its checkpoint is the latest published one or the
refresh already under way (the highest step any replica has started). Items of checkpoints
that were overtaken before their refresh began are acknowledged and skipped, so replicas
always move to the newest checkpoint without abandoning a refresh half-way (ANCE §4: the
Inferencer takes the most recent checkpoint when it starts a refresh).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from ance_train.common import events
from ance_train.common.checkpoint_cache import ModelCache
from ance_train.common.encoding import encode_texts
from ance_train.common.refresh import (
    CORPUS,
    embedding_key,
    pack_embeddings,
    query_order,
)
from ance_train.common.runtime import ServiceContext

# On CPU, batches of at most 4096 padded tokens encode faster than full 32-row batches of
# 256-token texts (bench/encode.py: 1.32x vs 1.16x over the padded baseline).
CPU_MAX_TOKENS_PER_BATCH = 4096

# Atomically raise the "refresh under way" marker; returns the marker after the update.
_RAISE_MAX = """
local current = tonumber(redis.call('GET', KEYS[1]) or '-1')
local proposed = tonumber(ARGV[1])
if proposed > current then redis.call('SET', KEYS[1], proposed); return proposed end
return current
"""


class Inferencer:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        cfg = ctx.config
        if cfg.inference.torch_threads:
            torch.set_num_threads(cfg.inference.torch_threads)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.queue = events.WorkQueue(ctx.bus, cfg.inference.claim_timeout_s)
        self.models = ModelCache(ctx.store, ctx.config.model, ctx.work_dir / "checkpoints",
                                 self.device)
        self.query_ids = query_order(ctx.dataset)
        self.max_tokens_per_batch = cfg.inference.max_tokens_per_batch or (
            CPU_MAX_TOKENS_PER_BATCH if self.device.type == "cpu" else None)
        self._raise_marker = ctx.redis.register_script(_RAISE_MAX)
        self.encoded = 0
        self.skipped = 0

    def run(self) -> None:
        ctx = self.ctx
        ctx.state.update(state="idle", phase="waiting for work")
        consumer = ctx.options.instance
        while not ctx.stop.is_set():
            try:
                item = self.queue.claim(consumer, block_ms=1000)
            except Exception as error:  # Redis restarting: back off and retry
                ctx.log.warning("claiming work failed: %s", error)
                ctx.stop.wait(1.0)
                continue
            if item is None:
                ctx.state.update(state="idle", phase="waiting for work")
                continue
            if not self._should_encode(item):
                self.skipped += 1
                ctx.log.info("skipping %s of superseded checkpoint %d", item.name, item.step)
                self.queue.done(item)
                continue
            self._encode(item, consumer)

    def _should_encode(self, item: events.WorkItem) -> bool:
        latest = self.ctx.bus.latest_checkpoint()
        under_way = int(self.ctx.redis.get(self.ctx.bus.key("refresh_under_way")) or -1)
        if item.step not in (latest, under_way):
            return False
        self._raise_marker(keys=[self.ctx.bus.key("refresh_under_way")], args=[item.step])
        return True

    def _encode(self, item: events.WorkItem, consumer: str) -> None:
        ctx, cfg = self.ctx, self.ctx.config
        ctx.state.update(state="running", phase=f"encoding {item.name}@{item.step}",
                         checkpoint_step=item.step, done=0, total=item.stop - item.start)
        beating = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(consumer, item, beating),
                                daemon=True)
        beat.start()
        started = time.monotonic()
        try:
            model, tokenizer = self.models.get(item.step)
            if item.kind == CORPUS:
                ids = np.arange(item.start, item.stop, dtype=np.int64)
                texts = [text for _, text in ctx.corpus.iter_range(item.start, item.stop)]
                max_length = cfg.model.max_doc_length
            else:
                ids = np.arange(item.start, item.stop, dtype=np.int64)
                texts = [ctx.dataset.queries[q] for q in self.query_ids[item.start:item.stop]]
                max_length = cfg.model.max_query_length
            vectors = encode_texts(model, tokenizer, texts, max_length=max_length,
                                   batch_size=cfg.inference.batch_size, device=self.device,
                                   max_tokens_per_batch=self.max_tokens_per_batch,
                                   progress=lambda n: ctx.state.update(done=n))
            key = embedding_key(item.step, item.kind, item.shard)
            ctx.store.put_bytes(key, pack_embeddings(ids, vectors))
        finally:
            beating.set()
            beat.join()
        seconds = time.monotonic() - started
        ctx.bus.publish(events.SHARD_ENCODED, item.step, kind=item.kind, shard=item.shard,
                        key=key, count=len(ids), seconds=seconds, instance=consumer,
                        attempt=item.attempt)
        self.queue.done(item)
        self.encoded += 1
        ctx.state.update(metrics={"docs_per_second": len(ids) / max(seconds, 1e-9),
                                  "shards_encoded": self.encoded,
                                  "shards_skipped": self.skipped})
        ctx.log.info("%s@%d: %d texts in %.1fs", item.name, item.step, len(ids), seconds)

    def _heartbeat(self, consumer: str, item: events.WorkItem, done: threading.Event) -> None:
        interval = max(self.ctx.config.inference.claim_timeout_s / 3, 0.2)
        while not done.wait(interval):
            try:
                self.queue.heartbeat(consumer, item)
            except Exception as error:
                self.ctx.log.warning("heartbeat for %s failed: %s", item.name, error)


def serve(ctx: ServiceContext) -> int:
    return ctx.serve(Inferencer(ctx).run)
