"""The trainer's one-batch lookahead (``trainer/prefetch.py``): batch s+1 is built before step s
and read + tokenised on a background thread while step s computes.

The real Trainer runs in this process against a real Redis server and a local store, on the
SciFact subset with the tiny BERT (dropout on, so the torch RNG order matters). Observation is
by instrumentation of the real parts (a wrapper that records the preparer's tokenizer calls and
forwards them, a gradient hook on the model), never by replacing them. The exact-resume tests
with the lookahead are ``tests/test_resume.py`` (one process) and
``tests/test_trainer_ranks.py`` (two ranks).
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from ance_train.data.problems import DataError
from ance_train.negatives.table import PAD, SOURCE_CODE, NegativesTable, uniform_probabilities
from ance_train.protocol import keys
from ance_train.protocol.events import NegativesReady
from ance_train.protocol.tables import TableId
from ance_train.runtime import ServiceOptions, connect_context
from ance_train.trainer.prefetch import PlannedBatch
from ance_train.trainer.trainer import Trainer
from ance_train.trainer.training_state import TrainingState

from ance_train_dev.service_harness import Harness

STEPS = 5
WORKER = "batch-prefetch"  # the preparer's thread name prefix


def _harness(root: Path, run_id: str, redis_url: str, model: Path, data: Path,
             negatives: dict | None = None, steps: int = STEPS) -> Harness:
    root.mkdir()
    return Harness.prepare(
        root, redis_url, run_id=run_id, data={"path": str(data), "dev_fraction": 0.2},
        model={"path": str(model), "max_query_length": 16, "max_doc_length": 32},
        training={"steps": steps, "batch_size": 4, "refresh_every": 3, "warmup_steps": 1,
                  "learning_rate": 1e-3, "torch_threads": 1, "mixed_precision": "off"},
        negatives=negatives or {"pool": "random", "per_query": 2, "warmup": "none"},
    )


_made: list[Trainer] = []


@pytest.fixture(autouse=True)
def _end_feeds(redis_server) -> Iterator[None]:
    """Stop the negatives feed thread of every trainer a test made before Redis goes away."""
    yield
    for trainer in _made:
        trainer.ctx.stop.set()
        if trainer.feed._thread.is_alive():
            trainer.feed._thread.join(timeout=10)
    _made.clear()


def _trainer(harness: Harness) -> Trainer:
    trainer = Trainer(connect_context(ServiceOptions(
        role="trainer", config_path=str(harness.config_path), redis_url=harness.redis_url,
        work_dir=str(harness.root / "work"), instance="trainer",
        store_dir=str(harness.root / "store"))))
    _made.append(trainer)
    return trainer


def _record_builds(trainer: Trainer) -> list:
    """The global batches the trainer builds, in order (the builder itself runs unchanged)."""
    built: list = []
    build = trainer.batches.build

    def recorded(*args, **kwargs):
        built.append(build(*args, **kwargs))
        return built[-1]

    trainer.batches.build = recorded
    return built


def _after_step(trainer: Trainer, action) -> None:
    """Call ``action(step)`` after each step is logged (the loop itself runs unchanged)."""
    log_step = trainer._log_step

    def logged(*args, **kwargs) -> None:
        log_step(*args, **kwargs)
        action(trainer.step)

    trainer._log_step = logged


def _worker_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(WORKER)]


def test_next_batch_is_tokenised_on_the_worker_while_the_step_runs_backward(
        tmp_path: Path, redis_server, tiny_model: Path, scifact_subset: Path) -> None:
    """Step 2's backward and the tokenisation of batch 3 meet at a barrier: each waits there
    for the other, so they are in progress at the same time, on two threads. Were batch 3
    tokenised on the loop's thread (before or after step 2), the barrier would time out and
    the run fail."""
    trainer = _trainer(_harness(tmp_path / "run", "overlap", redis_server.url, tiny_model,
                                scifact_subset))
    meet = threading.Barrier(2, timeout=60)
    calls: list[dict] = []  # every tokenisation: thread, start, end, first text
    tokenizer = trainer.preparer.tokenizer

    def recording_tokenizer(texts, **kwargs):
        call = {"thread": threading.current_thread().name, "text": texts[0],
                "start": time.perf_counter()}
        calls.append(call)
        if len(calls) == 5:  # calls 1-2: batch 1 (queries, docs), 3-4: batch 2, 5: batch 3
            meet.wait()
        encoded = tokenizer(texts, **kwargs)
        call["end"] = time.perf_counter()
        return encoded

    trainer.preparer.tokenizer = recording_tokenizer
    backward: dict[int, dict] = {}

    def in_backward(grad: torch.Tensor) -> None:
        step = backward.setdefault(trainer.step, {"thread": threading.current_thread().name,
                                                  "start": time.perf_counter()})
        if trainer.step == 2 and "met" not in step:
            meet.wait()
            step["met"] = time.perf_counter()

    trainer.model.encoder.embeddings.word_embeddings.weight.register_hook(in_backward)
    logged: dict[int, float] = {}  # when each step was logged (after its backward)
    _after_step(trainer, lambda step: logged.setdefault(step, time.perf_counter()))
    built = _record_builds(trainer)
    record = trainer.run()

    assert len(record.losses) == STEPS and len(built) == STEPS
    assert "met" in backward[2]
    assert {c["thread"] for c in calls} == {f"{WORKER}_0"}
    assert {b["thread"] for b in backward.values()} == {threading.current_thread().name}
    # Batch 3's queries were being tokenised, on the worker, while step 2's backward ran.
    batch3 = calls[4]
    assert batch3["text"] == built[2].query_texts[0]
    assert backward[2]["start"] < batch3["end"] and batch3["start"] < logged[2]
    assert len(record.prepare_ms) == len(record.prepare_wait_ms) == STEPS
    assert all(ms > 0 for ms in record.prepare_ms)
    assert _worker_threads() == [], "the prefetch thread outlived the run"


def test_lookahead_trains_the_sequential_sequence(tmp_path: Path, redis_server,
                                                  tiny_model: Path,
                                                  scifact_subset: Path) -> None:
    """The trainer with its lookahead against the sequential order, step by step, on a second
    trainer of the same config: build batch s, read + tokenise it, then optimise it. Same
    batches, same losses and same weights, bit for bit."""
    lookahead = _trainer(_harness(tmp_path / "a", "lookahead", redis_server.url, tiny_model,
                                  scifact_subset))
    built = _record_builds(lookahead)
    record = lookahead.run()
    weights = {k: v.clone() for k, v in lookahead.model.state_dict().items()}

    sequential = _trainer(_harness(tmp_path / "b", "sequential", redis_server.url, tiny_model,
                                   scifact_subset))
    reference_batches, reference_losses = [], []
    try:
        for step in range(1, STEPS + 1):
            sequential.step = step
            planned = sequential._plan(step)
            inputs = sequential.preparer.prepare(planned)  # on this thread, now
            loss, _ = sequential._optimise(planned.batch, inputs, 0.0)
            reference_batches.append(planned.batch)
            reference_losses.append(loss)
    finally:
        sequential.preparer.close()

    assert len(built) == STEPS
    for ours, theirs in zip(built, reference_batches, strict=True):
        assert ours.query_ids == theirs.query_ids
        assert ours.doc_indices == theirs.doc_indices
        assert torch.equal(ours.allowed, theirs.allowed)
    assert record.losses == reference_losses
    for name, tensor in sequential.model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name


def _disjoint_table(dataset, step: int, documents: range, top_k: int = 20) -> NegativesTable:
    """An ANN-shaped table whose candidates all lie in ``documents`` (never a positive)."""
    rng = np.random.default_rng(step)
    query_ids = sorted(dataset.train)
    candidates = np.full((len(query_ids), top_k), PAD, dtype=np.int64)
    for row, qid in enumerate(query_ids):
        pool = np.array([d for d in documents if d not in set(dataset.train[qid])])
        candidates[row] = rng.choice(pool, size=top_k, replace=False)
    return NegativesTable(
        step=step, query_ids=np.array(query_ids), candidates=candidates,
        scores=rng.random(candidates.shape, dtype=np.float32),
        positive_scores=np.ones(len(query_ids), np.float32),
        probabilities=uniform_probabilities(candidates),
        sources=np.full(candidates.shape, SOURCE_CODE["ann"], dtype=np.int8))


def test_a_swap_is_recorded_at_the_step_that_trains_on_the_new_table(
        tmp_path: Path, redis_server, tiny_model: Path, scifact_subset: Path) -> None:
    """Table 0 is there before step 1; table 2 arrives after step 2 (batch 3 is built by then).
    Batch 3 still draws from table 0, batch 4 from table 2, and the swap, the table steps and
    the async gaps say so at steps 4 and on."""
    trainer = _trainer(_harness(tmp_path / "run", "swap", redis_server.url, tiny_model,
                                scifact_subset,
                                negatives={"pool": "ann", "per_query": 2, "warmup": "none"}))
    ctx = trainer.ctx
    half = ctx.dataset.num_docs // 2
    tables = {0: _disjoint_table(ctx.dataset, 0, range(half)),
              2: _disjoint_table(ctx.dataset, 2, range(half, ctx.dataset.num_docs))}

    def publish(step: int) -> None:
        table = TableId.ann(step)
        ctx.store.put_bytes(table.key, tables[step].to_bytes())
        ctx.bus.publish(NegativesReady(tables=(table,)))

    def second_table_after_step_2(step: int) -> None:
        if step == 2:
            publish(2)
            assert trainer.feed.wait_until(
                lambda: trainer.feed.ann is not None and trainer.feed.ann.step == 2, 30)

    publish(0)
    _after_step(trainer, second_table_after_step_2)
    built = _record_builds(trainer)
    record = trainer.run()

    # (each swap also carries its times, for the refresh timeline)
    assert [(s["step"], s["negatives_step"]) for s in record.swaps] == [(1, 0), (4, 2)]
    assert record.negatives_steps == [0, 0, 0, 2, 2]
    assert record.async_gaps == [1, 2, 3, 2, 3]
    for step, batch in enumerate(built, 1):
        negatives = batch.doc_indices[len(batch.query_ids):]
        assert len(negatives) == 2 * len(batch.query_ids)
        in_first_half = [d < half for d in negatives]
        assert all(in_first_half) if step <= 3 else not any(in_first_half), step


def test_a_failure_on_the_worker_surfaces_in_the_loop(tmp_path: Path, redis_server,
                                                      tiny_model: Path,
                                                      scifact_subset: Path) -> None:
    """The corpus file is cut after step 1: batch 3, read on the worker during step 2, fails,
    and the run stops at step 3 with the corpus error — not a hang, not a skipped batch."""
    data = tmp_path / "data"
    shutil.copytree(scifact_subset, data)
    trainer = _trainer(_harness(tmp_path / "run", "failure", redis_server.url, tiny_model,
                                data))
    corpus = trainer.ctx.corpus.path

    def cut_corpus(step: int) -> None:
        if step == 1:
            with open(corpus, "r+b") as handle:
                handle.truncate(0)

    _after_step(trainer, cut_corpus)
    with pytest.raises(DataError, match="corpus file changed since validation"):
        trainer.run()
    assert len(trainer.record.losses) == 2  # batch 2 was read before the cut
    assert _worker_threads() == [], "the prefetch thread outlived the failed run"


def test_a_stop_trains_no_batch_past_it_and_ends_the_worker(tmp_path: Path, redis_server,
                                                            tiny_model: Path,
                                                            scifact_subset: Path) -> None:
    harness = _harness(tmp_path / "run", "stop", redis_server.url, tiny_model, scifact_subset)
    trainer = _trainer(harness)
    _after_step(trainer, lambda step: trainer.ctx.stop.set() if step == 2 else None)
    built = _record_builds(trainer)
    record = trainer.run()
    assert len(record.losses) == 2 and trainer.step == 2
    assert len(built) == 3  # batch 3 was built ahead, never trained
    assert _worker_threads() == []


def test_the_last_step_builds_nothing_ahead_and_checkpoints_hold_the_next_batch(
        tmp_path: Path, redis_server, tiny_model: Path, scifact_subset: Path) -> None:
    harness = _harness(tmp_path / "run", "ends", redis_server.url, tiny_model, scifact_subset)
    trainer = _trainer(harness)
    built = _record_builds(trainer)
    record = trainer.run()
    assert len(record.losses) == STEPS and len(built) == STEPS, "a batch past training.steps"
    assert record.checkpoints == [0, 3, STEPS]
    checkpoints = {step: TrainingState.load(_checkpoint_dir(harness, step))
                   for step in (0, 3, STEPS)}
    assert checkpoints[0].lookahead is None and checkpoints[STEPS].lookahead is None
    ahead = PlannedBatch.from_state(checkpoints[3].lookahead)
    assert ahead.step == 4
    assert ahead.batch.query_ids == built[3].query_ids
    assert ahead.batch.doc_indices == built[3].doc_indices
    assert torch.equal(ahead.batch.allowed, built[3].allowed)
    assert ahead.batch.dual_allowed is None


def _checkpoint_dir(harness: Harness, step: int) -> Path:
    target = harness.root / f"ckpt-{step}"
    harness.store.get_dir(keys.checkpoint(step), target)
    return target


def test_a_checkpoint_without_a_stored_batch_resumes_by_building_it(
        tmp_path: Path, redis_server, tiny_model: Path, scifact_subset: Path) -> None:
    """Checkpoint 0 stores no lookahead (nothing is built before it), as checkpoints written
    before the lookahead existed: a run resumed there builds batch 1 itself and trains as the
    uninterrupted run did."""
    a = _harness(tmp_path / "a", "whole", redis_server.url, tiny_model, scifact_subset)
    straight = _trainer(a).run()
    b = _harness(tmp_path / "b", "from-zero", redis_server.url, tiny_model, scifact_subset)
    b.store.put_dir(keys.checkpoint(0), _checkpoint_dir(a, 0))
    resumed_trainer = _trainer(b)
    assert resumed_trainer.resumed_from == 0 and resumed_trainer._lookahead is None
    resumed = resumed_trainer.run()
    assert resumed.resumed_from == [0]
    assert resumed.losses == straight.losses
