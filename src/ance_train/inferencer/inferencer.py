"""The Inferencer service: claims shard work items, encodes them, uploads the embeddings.

Replicas share one consumer group, so each item goes to one live replica; a replica keeps
its claim alive with heartbeats while encoding, and an item whose replica died is reclaimed
by another one after ``inference.claim_timeout_s``.

Supersession: an item is encoded only if its checkpoint is the latest published one or the
refresh already under way (the highest step any replica has started). Items of checkpoints
that were overtaken before their refresh began are acknowledged and skipped, so replicas
always move to the newest checkpoint without abandoning a refresh half-way (ANCE §4: the
Inferencer takes the most recent checkpoint when it starts a refresh). The one exception is
checkpoint 0, the zero-shot reference, which is always encoded.

Between refreshes (``inference.reuse_between_refreshes``) a replica keeps its encoder resident
and loads only the new weights (:class:`~ance_train.modeling.checkpoint_cache.ModelCache`),
and keeps the token ids of the shards it encoded (:mod:`.tokens`): the corpus and the
queries never change within a run, nor, unless a checkpoint says otherwise, the tokenizer.
An idle replica (no item to claim) fills that cache with every other shard of the run
(``inference.warm_token_cache``), ``WARM_SLICE`` texts per turn of its claim loop, so a
shard it has not encoded yet is not tokenised on a refresh's critical path; an item that
arrives waits at most for the slice in hand, and warming stops once the cache is full.

With MaxP (``data.passages.mode: max``) a corpus item's documents are cut into passages
(:class:`~ance_train.modeling.passages.PassageSplitter`) and every passage is encoded: the
shard holds a row per passage, with its document and passage number.

Poison items: an item whose checkpoint is corrupt or missing in the store is left for
redelivery (another replica may read it fine) until its ``inference.max_attempts``-th
delivery, then given up: ``shard.failed`` names the object and the error, the item is
acknowledged, and the indexer abandons that checkpoint instead of waiting for it forever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from ance_train.inferencer.tokens import WARM_SLICE, ShardRows, ShardWarming, TokenCache
from ance_train.inferencer.uploader import EncodedShard, ShardUploader
from ance_train.infra.bus import IDLE_BLOCK_MS, REDIS_UNAVAILABLE, WorkItem, WorkQueue
from ance_train.infra.store import CorruptObject, ObjectNotFound, StorageError
from ance_train.modeling.checkpoint_cache import ModelCache
from ance_train.modeling.encoding import (
    encode_ids,
    encode_texts,
    pad_token_id,
    prepare_model,
    resolve_precision,
    tokenize_texts,
)
from ance_train.modeling.model import TextKind, import_loading_code
from ance_train.modeling.passages import PassageSplitter
from ance_train.observability.telemetry import InferencerTelemetry
from ance_train.protocol.events import ShardFailed
from ance_train.protocol.work import RefreshPlan, ShardKind, query_order
from ance_train.runtime import ServiceContext

# On CPU, batches are capped at 4096 padded tokens (16 rows of 256 tokens): bounded memory and
# cache-sized matrices; docs/benchmarks/performance.md ("Encoding") has what it measures.
CPU_MAX_TOKENS_PER_BATCH = 4096


class Inferencer:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        cfg = ctx.config
        if cfg.inference.torch_threads:
            torch.set_num_threads(cfg.inference.torch_threads)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.queue = WorkQueue(ctx.bus, cfg.inference.claim_timeout_s)
        # bf16 / int8 (inference.precision) are applied once per checkpoint, when it is loaded.
        self.precision = resolve_precision(cfg.inference.precision, self.device)
        ctx.log.info("encoding on %s in %s (inference.precision %s)", self.device.type,
                     self.precision, cfg.inference.precision)
        # Weights copied into a resident model need a model whose parameters are tensors
        # of its dtype; int8's dynamic quantisation replaces them: reloaded whole.
        self.reuse = cfg.inference.reuse_between_refreshes
        self.models = ModelCache(ctx.store, ctx.config.model, ctx.work_dir / "checkpoints",
                                 self.device,
                                 prepare=lambda m: prepare_model(m, self.precision, self.device),
                                 reuse=self.reuse and self.precision != "int8")
        self.tokens = TokenCache(cfg.inference.token_cache_mb * 2**20 if self.reuse else 0)
        # Warming the cache while idle: every shard of the run (a plan's ranges do not depend
        # on its step), planned again whenever the tokenizer's checkpoint files change.
        self.warm = self.reuse and cfg.inference.warm_token_cache and self.tokens.max_bytes > 0
        self.plan = RefreshPlan.for_run(0, cfg, ctx.dataset)
        self._warm_for: str | None = None  # the fingerprint _to_warm was planned for
        self._to_warm: list[tuple[ShardKind, int, int]] = []
        self._warming: ShardWarming | None = None
        self.uploader = ShardUploader(ctx.store, ctx.bus, self.queue, self._uploaded,
                                      cfg.inference.embedding_dtype)
        self.query_ids = query_order(ctx.dataset)
        # MaxP encodes passages of data.passages.length tokens (default model.max_doc_length).
        self.doc_length = ((cfg.data.passages.length or cfg.model.max_doc_length)
                           if cfg.data.passages.enabled else cfg.model.max_doc_length)
        self.max_tokens_per_batch = cfg.inference.max_tokens_per_batch or (
            CPU_MAX_TOKENS_PER_BATCH if self.device.type == "cpu" else None)
        self.telemetry = InferencerTelemetry()
        self.encoded = 0
        self.skipped = 0

    def run(self) -> None:
        ctx = self.ctx
        ctx.state.update(state="idle", phase="importing the model code")
        import_loading_code()  # while the trainer makes checkpoint 0, not after it arrives
        ctx.state.update(state="idle", phase="waiting for work")
        consumer = ctx.options.instance
        while not ctx.stop.is_set():
            warming = self._warm_pending()
            try:
                # While warming, only a look at the queue between slices: an item is claimed
                # at most one slice after it arrives.
                item = self.queue.claim(consumer, block_ms=0 if warming else IDLE_BLOCK_MS)
            except REDIS_UNAVAILABLE as error:  # back off and retry
                ctx.log.warning("claiming work failed: %s", error)
                ctx.stop.wait(1.0)
                continue
            if item is None:
                if warming:
                    ctx.state.update(state="idle", phase="warming the token cache")
                    self._warm_turn()
                else:
                    ctx.state.update(state="idle", phase="waiting for work")
                continue
            try:
                self._handle(item, consumer)
            except (*REDIS_UNAVAILABLE, StorageError) as error:
                # Not acknowledged: the item is delivered again after claim_timeout_s.
                ctx.log.warning("%s@%d left for redelivery: %s", item.name, item.step, error)
                ctx.stop.wait(1.0)
        self.uploader.close()  # the last shard's upload finishes before the service stops

    def _handle(self, item: WorkItem, consumer: str) -> None:
        if not self._should_encode(item):
            self.skipped += 1
            self.ctx.log.info("skipping %s of superseded checkpoint %d", item.name, item.step)
            self.queue.done(item)
            return
        try:
            self._encode(item, consumer)
        except (CorruptObject, ObjectNotFound) as error:  # the checkpoint cannot be read
            if item.attempt < self.ctx.config.inference.max_attempts:
                raise  # left for redelivery
            self._give_up(item, consumer, error)

    def _give_up(self, item: WorkItem, consumer: str, error: StorageError) -> None:
        """Announce the item as failed, then acknowledge it (a crash in between only repeats
        the announcement, which the indexer treats idempotently)."""
        self.ctx.log.error("giving up %s of checkpoint %d after %d attempts: %s", item.name,
                           item.step, item.attempt, error)
        self.ctx.bus.publish(ShardFailed(step=item.step, kind=item.kind, shard=item.shard,
                                         key=item.key, instance=consumer,
                                         attempt=item.attempt, error=str(error)))
        self.queue.done(item)

    def _should_encode(self, item: WorkItem) -> bool:
        """See :meth:`~ance_train.infra.bus.EventBus.start_encoding` (supersession)."""
        return self.ctx.bus.start_encoding(item.step)

    def _encode(self, item: WorkItem, consumer: str) -> None:
        ctx, cfg = self.ctx, self.ctx.config
        ctx.state.update(state="running", phase=f"encoding {item.name}@{item.step}",
                         checkpoint_step=item.step, done=0, total=item.stop - item.start)
        beating = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(consumer, item, beating),
                                daemon=True)
        beat.start()

        def release() -> None:
            beating.set()
            beat.join()

        claimed_at = time.time()
        started = time.monotonic()
        try:
            known = self.models.step
            model, tokenizer = self.models.get(item.step)
            loaded, loaded_at = time.monotonic(), time.time()
            max_length, kind = self._lengths(item.kind)
            prompt = model.prompt(kind)
            if self.reuse:
                key = self._token_key(item.kind, item.start, item.stop, prompt)
                rows = self.tokens.get(key)
                cached = rows is not None
                if rows is None:  # tokenised on a background thread while the model runs,
                    # the ids kept (encode_ids of them gives the same batches, so the same bits)
                    tokenized, tokenized_at = loaded, loaded_at
                    rows = self._rows(item.kind, item.start, item.stop, tokenizer, prompt)
                    assert rows.texts is not None  # ``_rows`` reads them
                    token_ids: list = []
                    vectors = encode_texts(model, tokenizer, rows.texts,
                                           max_length=max_length, kind=kind,
                                           batch_size=cfg.inference.batch_size,
                                           device=self.device,
                                           max_tokens_per_batch=self.max_tokens_per_batch,
                                           progress=self._progress(), background=True,
                                           token_ids=token_ids)
                    rows.token_ids = token_ids
                    self.tokens.put(key, rows)
                else:
                    tokenized, tokenized_at = time.monotonic(), time.time()
                    assert rows.token_ids is not None  # set before the rows were cached
                    vectors = encode_ids(model, rows.token_ids, pad_token_id(tokenizer),
                                         batch_size=cfg.inference.batch_size,
                                         device=self.device,
                                         max_tokens_per_batch=self.max_tokens_per_batch,
                                         progress=self._progress())
            else:  # tokenised on a background thread while the model runs, every refresh
                cached, tokenized, tokenized_at = False, loaded, loaded_at
                rows = self._rows(item.kind, item.start, item.stop, tokenizer, prompt)
                assert rows.texts is not None  # ``_rows`` reads them
                vectors = encode_texts(model, tokenizer, rows.texts,
                                       max_length=max_length, kind=kind,
                                       batch_size=cfg.inference.batch_size, device=self.device,
                                       max_tokens_per_batch=self.max_tokens_per_batch,
                                       progress=self._progress(), background=True)
        except BaseException:
            release()
            raise
        encoded = time.monotonic()
        timings = {"load_s": loaded - started, "encode_s": encoded - loaded,
                   "tokenize_s": tokenized - loaded}
        times = {"claimed_at": claimed_at, "loaded_at": loaded_at, "tokenized_at": tokenized_at,
                 "encoded_at": time.time(), "tokens_cached": cached,
                 "model_reloaded": bool(self.models.reloaded) and known != item.step}
        # Stored, announced and acknowledged in the background while the next shard encodes.
        self.uploader.submit(EncodedShard(item, consumer, rows.ids, vectors, timings, release,
                                          times, rows.passages))

    def _lengths(self, kind: ShardKind) -> tuple[int, TextKind]:
        """The token length cap and the text kind (for the prompt) of shards of ``kind``."""
        if kind is ShardKind.CORPUS:
            return self.doc_length, "document"
        return self.ctx.config.model.max_query_length, "query"

    def _token_key(self, kind: ShardKind, start: int, stop: int, prompt: str) -> tuple:
        """What the token ids of shard ``[start, stop)`` of ``kind`` depend on (the
        :class:`TokenCache` key) with the loaded checkpoint."""
        return (kind, start, stop, self._lengths(kind)[0], prompt,
                self.ctx.config.data.passages, self.models.fingerprint)

    def _rows(self, kind: ShardKind, start: int, stop: int, tokenizer,
              prompt: str) -> ShardRows:
        """The rows of shard ``[start, stop)`` of ``kind`` with their texts: its documents
        (with MaxP, their passages) or its queries. Query shards carry the query ids, so no
        reader relies on an order."""
        if kind is not ShardKind.CORPUS:
            ids = np.array(self.query_ids[start:stop], dtype=np.str_)
            return ShardRows(ids, texts=[self.ctx.dataset.queries[q] for q in ids])
        texts = [text for _, text in self.ctx.corpus.iter_range(start, stop)]
        passages = self.ctx.config.data.passages
        if not passages.enabled:
            return ShardRows(np.arange(start, stop, dtype=np.int64), texts=texts)
        split = PassageSplitter(tokenizer, passages, self.ctx.config.model.max_doc_length,
                                prompt).split(texts)
        return ShardRows(start + split.documents, split.passages, texts=split.texts)

    def _warm_pending(self) -> bool:
        """Whether an idle turn has a shard to tokenise into the cache: once a checkpoint is
        loaded (its tokenizer and prompts), every shard of the run not cached yet."""
        if not self.warm or self.models.model is None:
            return False
        if self._warm_for != self.models.fingerprint:  # the first checkpoint, or a new tokenizer
            self._warm_for = self.models.fingerprint
            self._to_warm = [(kind, start, stop) for kind in (ShardKind.CORPUS, ShardKind.QUERIES)
                             for start, stop in self.plan.ranges(kind)]
            self._warming = None
        return bool(self._to_warm) or self._warming is not None

    def _warm_turn(self) -> None:
        """Tokenise the next :data:`WARM_SLICE` texts of the shard being warmed (the next shard
        not in the cache, if none is); a shard whose last slice is done goes into the cache,
        and warming stops for good when the cache has no room for it."""
        model, tokenizer = self.models.model, self.models.tokenizer
        assert model is not None and tokenizer is not None  # see _warm_pending
        if self._warming is None:
            shard, start, stop = self._to_warm.pop(0)
            key = self._token_key(shard, start, stop, model.prompt(self._lengths(shard)[1]))
            if self.tokens.get(key) is not None:  # encoded, hence cached, already
                return
            self._warming = ShardWarming(key, shard, start, stop, offset=start, parts=[])
        warming = self._warming
        max_length, kind = self._lengths(warming.kind)
        prompt = model.prompt(kind)
        end = min(warming.offset + WARM_SLICE, warming.stop)
        rows = self._rows(warming.kind, warming.offset, end, tokenizer, prompt)
        assert rows.texts is not None  # ``_rows`` reads them
        rows.token_ids = tokenize_texts(tokenizer, rows.texts, max_length, prompt)
        rows.texts = None
        warming.parts.append(rows)
        warming.offset = end
        if end < warming.stop:
            return
        self._warming = None
        if not self.tokens.put(warming.key, warming.rows()):
            self.ctx.log.info("token cache full (%d bytes): no more warming", self.tokens.bytes)
            self._to_warm.clear()

    def _progress(self) -> Callable[[int], None]:
        """A progress callback that reports the texts encoded so far in the current item."""
        done = 0

        def advance(count: int) -> None:
            nonlocal done
            done += count
            self.ctx.state.update(done=done)

        return advance

    def _uploaded(self, shard: EncodedShard, seconds: float) -> None:
        """Bookkeeping after a shard's upload (called on the uploader thread)."""
        count = len(shard.ids)
        self.encoded += 1
        self.telemetry.shard_encoded(count, seconds)
        self.ctx.state.update(metrics={"docs_per_second": count / max(seconds, 1e-9),
                                       "shards_encoded": self.encoded,
                                       "shards_skipped": self.skipped})
        self.ctx.log.info("%s@%d: %d texts in %.1fs (%s)", shard.item.name, shard.item.step,
                          count, seconds, ", ".join(f"{k} {v:.2f}" for k, v in
                                                    shard.timings.items()))

    def _heartbeat(self, consumer: str, item: WorkItem, done: threading.Event) -> None:
        interval = max(self.ctx.config.inference.claim_timeout_s / 3, 0.2)
        while not done.wait(interval):
            try:
                self.queue.heartbeat(consumer, item)
            except REDIS_UNAVAILABLE as error:  # the next beat retries
                self.ctx.log.warning("heartbeat for %s failed: %s", item.name, error)


def serve(ctx: ServiceContext) -> int:
    return ctx.serve(Inferencer(ctx).run)
