"""The typed protocol (src/ance_train/protocol/): events validated on read, dead-lettering on a
real Redis server, table identities, object keys and the supersession rules."""

from __future__ import annotations

import json

import pytest

from ance_train.infra.bus import EventBus, WorkQueue
from ance_train.protocol import keys
from ance_train.protocol.events import (
    EVENT_TYPES,
    CheckpointPublished,
    EvalCompleted,
    MalformedMessage,
    NegativesReady,
    RunFinished,
    ShardEncoded,
    ShardFailed,
)
from ance_train.protocol.supersession import next_to_build, superseded, worth_encoding
from ance_train.protocol.tables import TableId, TableKind
from ance_train.protocol.work import CORPUS, QUERIES, RefreshPlan, ShardWork

PLAN = RefreshPlan(step=3, corpus_ranges=((0, 10), (10, 15)), query_ranges=((0, 4),))

EXAMPLES = [
    CheckpointPublished(step=3, key=keys.checkpoint(3), plan=PLAN),
    ShardEncoded(step=3, kind=CORPUS, shard=1, key=keys.embedding_shard(3, CORPUS, 1), count=5,
                 instance="inf-0", attempt=2, finished_at=1.5, seconds=0.7, load_s=0.1,
                 encode_s=0.5, upload_s=0.1, wait_s=0.0),
    ShardFailed(step=3, kind=QUERIES, shard=0, key=keys.embedding_shard(3, QUERIES, 0),
                instance="inf-1", attempt=3, error="checkpoints/3/model.safetensors: sha256"),
    NegativesReady(tables=(TableId.bm25(),)),
    NegativesReady(tables=(TableId.ann(3), TableId.dual(3))),
    EvalCompleted(step=3, key=keys.eval_report(3), metrics={"dev": {"ndcg_cut_10": 0.5}},
                  timings={"build_s": 1.0}, diagnostics={"overlap": 0.3}),
    RunFinished(step=60),
]


@pytest.mark.parametrize("event", EXAMPLES, ids=lambda e: e.TYPE)
def test_every_event_round_trips_through_json(event) -> None:
    decoded = type(event).decode(event.encode())
    assert decoded == event
    assert json.loads(event.encode())["version"] == 1
    assert EVENT_TYPES[event.TYPE] is type(event)


@pytest.mark.parametrize(("data", "named"), [
    ("{not json", "Expecting property name"),
    (json.dumps({"run_id": "r"}), "step: Field required"),
    (json.dumps({"run_id": "r", "step": 1, "extra": 1}), "extra: Extra inputs are not permitted"),
    (json.dumps({"run_id": "r", "step": "one"}), "step: Input should be a valid integer"),
    (json.dumps({"run_id": "r", "step": -2}), "step: Input should be greater than or equal"),
    (json.dumps({"run_id": "r", "step": 1, "version": 2}), "schema version 2 is not supported"),
])
def test_a_malformed_event_is_rejected_naming_the_problem(data: str, named: str) -> None:
    with pytest.raises(MalformedMessage, match=r"not a valid run\.finished message") as raised:
        RunFinished.decode(data)
    assert named in str(raised.value)


def test_a_plan_must_belong_to_its_checkpoint() -> None:
    with pytest.raises(ValueError, match="plan of step 3 in the event of step 4"):
        CheckpointPublished(step=4, key=keys.checkpoint(4), plan=PLAN)


def test_table_identity_replaces_magic_steps() -> None:
    assert TableId.bm25().key == "negatives/bm25.npz"
    assert TableId.ann(40).key == "negatives/40.npz"
    assert TableId.dual(40).key == "negatives/40-dual.npz"
    assert TableId.ann(0).kind is TableKind.ANN
    with pytest.raises(ValueError, match="BM25 table is mined before any checkpoint"):
        TableId(kind=TableKind.BM25, step=-1)
    with pytest.raises(ValueError, match="needs the step"):
        TableId(kind=TableKind.ANN)
    with pytest.raises(ValueError, match="at most one of each kind"):
        NegativesReady(tables=(TableId.ann(3), TableId.ann(3)))
    with pytest.raises(ValueError, match="of one checkpoint"):
        NegativesReady(tables=(TableId.ann(3), TableId.dual(4)))
    ready = NegativesReady(tables=(TableId.ann(3), TableId.dual(3)))
    assert ready.step == 3 and ready.table(TableKind.DUAL) == TableId.dual(3)
    assert ready.table(TableKind.BM25) is None
    assert NegativesReady(tables=(TableId.bm25(),)).step is None


def test_object_keys() -> None:
    assert keys.checkpoint(20) == "checkpoints/20"
    assert keys.checkpoint_step("checkpoints/20/MANIFEST.json") == 20
    assert keys.checkpoint_step("eval/20.json") is None
    assert keys.embedding_shard(20, CORPUS, 7) == "embeddings/20/corpus-00007.npz"
    assert keys.eval_report(20) == "eval/20.json"
    assert keys.DATASET_INDEX == "data/dataset.json" and keys.DOC_OFFSETS == "data/doc_offsets.npy"
    assert keys.TRAINER_SUMMARY == "trainer/summary.json"


def test_refresh_plan_work_items_and_expected_keys() -> None:
    corpus = PLAN.work(CORPUS)
    assert [(w.shard, w.start, w.stop) for w in corpus] == [(0, 0, 10), (1, 10, 15)]
    assert corpus[1].key == "embeddings/3/corpus-00001.npz" and corpus[1].name == "corpus-00001"
    assert PLAN.expected_keys() == {"embeddings/3/corpus-00000.npz",
                                    "embeddings/3/corpus-00001.npz",
                                    "embeddings/3/queries-00000.npz"}
    assert PLAN.num_docs == 15
    with pytest.raises(ValueError, match="stop 1 < start 2"):
        ShardWork(step=0, kind=CORPUS, shard=0, start=2, stop=1)


def test_supersession_rules() -> None:
    # Inferencers: the latest checkpoint, the refresh under way, and always checkpoint 0.
    assert worth_encoding(6, latest=6, under_way=3)
    assert worth_encoding(3, latest=6, under_way=3)
    assert worth_encoding(0, latest=6, under_way=3)
    assert not worth_encoding(4, latest=6, under_way=3)
    # Indexer: checkpoint 0 first (waiting for it), then the newest complete checkpoint.
    assert next_to_build({0: False, 3: True}, last_built=None) is None
    assert next_to_build({0: True, 3: True}, last_built=None) == 0
    assert next_to_build({3: True, 6: True, 9: False}, last_built=0) == 6
    assert next_to_build({3: True}, last_built=3) is None
    assert superseded(3, next_step=6) and not superseded(6, next_step=6)
    assert not superseded(0, next_step=6), "checkpoint 0 is never superseded"
    assert not superseded(3, next_step=None)


# -- on a real Redis server ---------------------------------------------------------------
def _raw(bus: EventBus, event_type, data: str) -> str:
    """What a faulty or foreign producer could put in a stream."""
    return bus.client.xadd(bus.stream(event_type), {"data": data})


def test_malformed_event_is_dead_lettered_and_the_consumer_goes_on(bus: EventBus) -> None:
    good = bus.publish(RunFinished(step=1))
    bad_json = _raw(bus, RunFinished, "{oops")
    bad_field = _raw(bus, RunFinished, json.dumps({"run_id": bus.run_id, "step": "x"}))
    other_run = _raw(bus, RunFinished, RunFinished(run_id="another-run", step=2).encode())
    later = bus.publish(RunFinished(step=3))

    got = bus.consume(RunFinished, "g", "c", block_ms=100)
    assert [r.entry_id for r in got] == [good, later]
    assert [r.event.step for r in got] == [1, 3]
    letters = bus.dead_letters()
    assert [d.original_id for d in letters] == [bad_json, bad_field, other_run]
    assert all(d.stream == bus.stream(RunFinished) for d in letters)
    assert "step: Input should be a valid integer" in letters[1].error
    assert "run_id 'another-run'" in letters[2].error
    assert letters[1].data == json.dumps({"run_id": bus.run_id, "step": "x"})
    # Dead-lettered entries were acknowledged: never delivered again, never retried.
    for received in got:
        bus.ack(RunFinished, "g", received.entry_id)
    assert bus.consume(RunFinished, "g", "c", block_ms=100) == []
    assert bus.client.xpending(bus.stream(RunFinished), "g")["pending"] == 0
    assert len(bus.dead_letters()) == 3
    # Observers skip them without dead-lettering them again.
    assert [r.event.step for r in bus.history(RunFinished)] == [1, 3]
    assert len(bus.dead_letters()) == 3


def test_malformed_work_item_is_dead_lettered_and_the_next_one_claimed(bus: EventBus) -> None:
    queue = WorkQueue(bus, claim_timeout_s=30)
    bad = _raw(bus, ShardWork, json.dumps({"run_id": bus.run_id, "step": 0, "kind": "images",
                                           "shard": 0, "start": 0, "stop": 5}))
    queue.enqueue([ShardWork(step=0, kind=CORPUS, shard=1, start=5, stop=9)])
    item = queue.claim("r0", block_ms=0)
    assert item is not None and (item.shard, item.start, item.stop) == (1, 5, 9)
    (letter,) = bus.dead_letters()
    assert letter.original_id == bad and "kind: Input should be 'corpus' or 'queries'" in \
        letter.error
    assert queue.pending_count() == 1  # only the good item, held by r0
    queue.done(item)
    assert queue.claim("r0", block_ms=0) is None
