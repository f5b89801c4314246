"""An idle inferencer warms its token cache (``inference.warm_token_cache``,
:meth:`ance_train.inferencer.inferencer.Inferencer._warm_turn`).

A real inferencer (real Redis, local store holding a tiny model as checkpoint 0, the SciFact
subset) is driven by hand or through its loop. What is checked: warming fills the cache with
every shard of the run, slice by slice, with the rows and token ids a shard tokenised whole
has; a shard encoded from warmed ids has the bits of one tokenised at encoding time; an item
that arrives while the replica warms is claimed after the slice in hand; warming stops when
the cache is full.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import pytest

from ance_train.config import load_config
from ance_train.data.corpus import open_corpus
from ance_train.data.validation import validate_dataset
from ance_train.inferencer import inferencer as inferencer_module
from ance_train.inferencer.inferencer import WARM_SLICE, Inferencer
from ance_train.infra.bus import EventBus
from ance_train.infra.store import LocalStore
from ance_train.modeling.encoding import encode_ids, encode_texts, pad_token_id, tokenize_texts
from ance_train.protocol import keys
from ance_train.protocol.embeddings import unpack_embeddings
from ance_train.protocol.events import ShardEncoded
from ance_train.protocol.work import RefreshPlan, ShardKind
from ance_train.runtime import ServiceContext, ServiceOptions

from ance_train_dev.helpers import write_config

MAXP = {"passages": {"mode": "max", "max_passages": 4}}


def _inferencer(tmp_path: Path, bus: EventBus, data: Path, model: Path,
                data_extra: dict | None = None, **inference: object) -> Inferencer:
    config_path = write_config(
        tmp_path / "run.yaml", run_id=bus.run_id,
        data={"path": str(data), **(data_extra or {})},
        model={"path": str(model), "max_doc_length": 32, "max_query_length": 16},
        inference={"shard_size": 70, "query_shard_size": 50, "embedding_dtype": "float32",
                   "batch_size": 8, **inference})
    config = load_config(config_path)
    store = LocalStore(config.run_id, tmp_path / "store")
    store.put_dir(keys.checkpoint(0), model)
    ctx = ServiceContext(
        options=ServiceOptions(role="inferencer", config_path=str(config_path),
                               redis_url="redis://unused", work_dir=str(tmp_path / "work"),
                               instance="inferencer-0"),
        config=config, log=logging.getLogger("test.token-warming"),
        work_dir=tmp_path / "work", store=store, redis=bus.client, bus=bus,
        dataset=validate_dataset(config.data, tmp_path / "cache"),
        corpus=open_corpus(config.data, tmp_path / "cache"), stop=threading.Event())
    return Inferencer(ctx)


def _shards(inferencer: Inferencer) -> list[tuple[ShardKind, int, int]]:
    plan = inferencer.plan
    return [(kind, start, stop) for kind in (ShardKind.CORPUS, ShardKind.QUERIES)
            for start, stop in plan.ranges(kind)]


def _warm_all(inferencer: Inferencer) -> int:
    turns = 0
    while inferencer._warm_pending():
        inferencer._warm_turn()
        turns += 1
    return turns


@pytest.mark.parametrize("data_extra", [None, MAXP], ids=["documents", "maxp"])
def test_warming_caches_every_shard_as_tokenised_whole(
        tmp_path: Path, bus: EventBus, scifact_subset: Path, tiny_model: Path,
        data_extra: dict | None) -> None:
    inferencer = _inferencer(tmp_path, bus, scifact_subset, tiny_model, data_extra)
    assert not inferencer._warm_pending()  # no checkpoint loaded yet: no tokenizer to warm with
    model, tokenizer = inferencer.models.get(0)
    shards = _shards(inferencer)
    assert len([s for s in shards if s[0] is ShardKind.CORPUS]) > 1
    turns = _warm_all(inferencer)
    texts = sum(stop - start for _, start, stop in shards)
    assert turns >= texts / WARM_SLICE  # a turn tokenises one slice at most
    for kind, start, stop in shards:
        max_length, text_kind = inferencer._lengths(kind)
        prompt = model.prompt(text_kind)
        cached = inferencer.tokens.get(inferencer._token_key(kind, start, stop, prompt))
        assert cached is not None, (kind, start)
        whole = inferencer._rows(kind, start, stop, tokenizer, prompt)
        assert whole.texts is not None
        assert cached.ids.tolist() == whole.ids.tolist()
        if whole.passages is None:
            assert cached.passages is None
        else:
            assert cached.passages is not None
            assert cached.passages.tolist() == whole.passages.tolist()
        expected = tokenize_texts(tokenizer, whole.texts, max_length, prompt)
        assert [row.tolist() for row in cached.token_ids or ()] == expected
    if data_extra:  # documents longer than a passage were cut: more rows than documents
        corpus = [inferencer.tokens.get(inferencer._token_key(ShardKind.CORPUS, a, b,
                                                              model.prompt("document")))
                  for _, a, b in shards if _ == ShardKind.CORPUS]
        assert sum(len(rows.ids) for rows in corpus if rows) > inferencer.plan.num_docs


def test_a_warmed_shard_encodes_to_the_same_bits(
        tmp_path: Path, bus: EventBus, scifact_subset: Path, tiny_model: Path) -> None:
    """The shard stored by a replica that warmed its cache (no tokenisation when the item
    came) holds the vectors of the texts tokenised while encoding (the path without reuse)."""
    inferencer = _inferencer(tmp_path, bus, scifact_subset, tiny_model)
    model, tokenizer = inferencer.models.get(0)
    _warm_all(inferencer)
    plan = RefreshPlan.for_run(0, inferencer.ctx.config, inferencer.ctx.dataset)
    works = [plan.work(ShardKind.CORPUS)[1], plan.work(ShardKind.QUERIES)[0]]
    inferencer.queue.enqueue(works)
    for _ in works:
        item = inferencer.queue.claim("inferencer-0", block_ms=1000)
        assert item is not None
        inferencer._handle(item, "inferencer-0")
    inferencer.uploader.close()
    events = {e.event.kind: e.event for e in bus.history(ShardEncoded)}
    assert all(event.tokens_cached for event in events.values())
    for work in works:
        ids, vectors = unpack_embeddings(inferencer.ctx.store.get_bytes(work.key))
        _, text_kind = inferencer._lengths(work.kind)
        rows = inferencer._rows(work.kind, work.start, work.stop, tokenizer,
                                model.prompt(text_kind))
        assert rows.texts is not None
        expected = encode_texts(model, tokenizer, rows.texts,
                                max_length=inferencer._lengths(work.kind)[0], kind=text_kind,
                                batch_size=8, max_tokens_per_batch=inferencer.max_tokens_per_batch,
                                background=True)
        assert ids.tolist() == rows.ids.tolist()
        np.testing.assert_array_equal(vectors, expected)


def test_an_item_is_claimed_after_the_slice_in_hand(
        tmp_path: Path, bus: EventBus, scifact_subset: Path, tiny_model: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Work published while the replica warms is taken at the next look at the queue: one
    slice later, with most of the corpus still to warm (which resumes once idle again)."""
    inferencer = _inferencer(tmp_path, bus, scifact_subset, tiny_model)
    inferencer.models.get(0)
    plan = RefreshPlan.for_run(0, inferencer.ctx.config, inferencer.ctx.dataset)
    turns: list[int] = []
    handled: list[tuple[str, int]] = []
    warm_turn = inferencer._warm_turn

    def turn() -> None:
        warm_turn()
        turns.append(1)
        if len(turns) == 1:  # work arrives while the replica warms
            inferencer.queue.enqueue(plan.work(ShardKind.QUERIES))

    def handle(item, consumer: str) -> None:
        handled.append((item.name, len(turns)))
        inferencer.queue.done(item)

    monkeypatch.setattr(inferencer, "_warm_turn", turn)
    monkeypatch.setattr(inferencer, "_handle", handle)
    monkeypatch.setattr(inferencer_module.WorkQueue, "claim",
                        _counting(inferencer_module.WorkQueue.claim, inferencer, turns))
    loop = threading.Thread(target=inferencer.run)
    loop.start()
    loop.join(60)
    assert not loop.is_alive()
    # every item claimed right after the first slice, before any other
    assert handled == [(work.name, 1) for work in plan.work(ShardKind.QUERIES)]
    # then warming went on where it stopped, to the end
    assert len(turns) >= plan.num_docs / WARM_SLICE
    assert not inferencer._warm_pending()


def _counting(claim, inferencer: Inferencer, turns: list[int]):
    """``WorkQueue.claim`` that stops the replica once it has nothing left to warm."""
    def wrapped(queue, consumer: str, block_ms: int = 1000):
        if not inferencer._warm_pending():
            inferencer.ctx.stop.set()
        assert block_ms == 0 or not inferencer._warm_pending()  # never blocks while warming
        return claim(queue, consumer, block_ms=block_ms)
    return wrapped


def test_warming_stops_when_the_cache_is_full(
        tmp_path: Path, bus: EventBus, scifact_subset: Path, tiny_model: Path) -> None:
    inferencer = _inferencer(tmp_path, bus, scifact_subset, tiny_model)
    model, _ = inferencer.models.get(0)
    first = _shards(inferencer)[0]
    key = inferencer._token_key(*first, model.prompt("document"))
    inferencer.tokens.max_bytes = 1  # room for nothing
    turns = _warm_all(inferencer)
    assert turns == -(-(first[2] - first[1]) // WARM_SLICE)  # the first shard, then no more
    assert inferencer.tokens.get(key) is None and inferencer.tokens.bytes == 0


@pytest.mark.parametrize("inference", [{"warm_token_cache": False},
                                       {"reuse_between_refreshes": False},
                                       {"token_cache_mb": 0}])
def test_no_warming_without_a_cache_or_when_off(
        tmp_path: Path, bus: EventBus, scifact_subset: Path, tiny_model: Path,
        inference: dict) -> None:
    inferencer = _inferencer(tmp_path, bus, scifact_subset, tiny_model, **inference)
    inferencer.models.get(0)
    assert not inferencer._warm_pending()


def test_a_shard_not_cached_keeps_the_ids_it_was_encoded_from(
        tmp_path: Path, bus: EventBus, scifact_subset: Path, tiny_model: Path) -> None:
    """Without warming, a shard's first encoding tokenises it on the background thread and
    keeps those ids: the whole shard's ids, which encode to the bits it stored."""
    inferencer = _inferencer(tmp_path, bus, scifact_subset, tiny_model, warm_token_cache=False)
    plan = RefreshPlan.for_run(0, inferencer.ctx.config, inferencer.ctx.dataset)
    work = plan.work(ShardKind.CORPUS)[0]
    inferencer.queue.enqueue([work])
    item = inferencer.queue.claim("inferencer-0", block_ms=1000)
    assert item is not None
    inferencer._handle(item, "inferencer-0")
    inferencer.uploader.close()
    (event,) = [e.event for e in bus.history(ShardEncoded)]
    assert event.tokens_cached is False
    model, tokenizer = inferencer.models.get(0)
    prompt = model.prompt("document")
    cached = inferencer.tokens.get(inferencer._token_key(work.kind, work.start, work.stop,
                                                         prompt))
    assert cached is not None and cached.token_ids is not None
    whole = inferencer._rows(work.kind, work.start, work.stop, tokenizer, prompt)
    assert whole.texts is not None
    assert [row.tolist() for row in cached.token_ids] == tokenize_texts(
        tokenizer, whole.texts, inferencer.doc_length, prompt)
    _, stored = unpack_embeddings(inferencer.ctx.store.get_bytes(work.key))
    again = encode_ids(model, cached.token_ids, pad_token_id(tokenizer), batch_size=8,
                       max_tokens_per_batch=inferencer.max_tokens_per_batch)
    np.testing.assert_array_equal(stored, again)
