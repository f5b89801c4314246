"""A checkpoint whose weights are corrupt in the store is given up on, not retried forever.

Checkpoints cannot be re-created once the trainer has moved on, so an unreadable one must not
stall the run. Each test lets the trainer publish first, truncates checkpoint 0's weights in
place on disk (the recorded sha256 stays), and only then starts the inferencer and indexer
(OS processes, real Redis, local store):

- with in-batch negatives the trainer has already published 0, 3 and 6: every item of
  checkpoint 0 is retried until ``inference.max_attempts``, then announced as
  ``shard.failed``; the indexer abandons checkpoint 0 and builds checkpoint 6 instead (3 is
  overtaken, as usual); no service exits;
- with ANN negatives and no BM25 warm-up the trainer is waiting for checkpoint 0's negatives,
  which can never come: it must stop with an error that names the corrupt object.
"""

from __future__ import annotations

import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from ance_train.infra.bus import EventBus, connect
from ance_train.protocol.events import CheckpointPublished, EvalCompleted, ShardEncoded, ShardFailed

from ance_train_dev.fault_report import record_fault
from ance_train_dev.fault_run import entry_ms
from ance_train_dev.service_harness import (
    Harness,
    checkpoint_steps,
    stop,
    three_checkpoint_sections,
    wait_until,
)

pytestmark = pytest.mark.fault

MAX_ATTEMPTS = 2


def _prepare(tmp_path: Path, redis_url: str, run_id: str, scifact_subset: Path, tiny_model: Path,
             negatives: dict) -> Harness:
    return Harness.prepare(tmp_path, redis_url, **three_checkpoint_sections(
        run_id, scifact_subset, tiny_model, negatives, claim_timeout_s=1.5,
        max_attempts=MAX_ATTEMPTS))


def _corrupt_weights(harness: Harness, step: int) -> str:
    """Truncate the checkpoint's weights file on disk; returns its store key."""
    directory = harness.root / "store" / harness.config.run_id / "checkpoints" / str(step)
    weights = max(directory.rglob("*.safetensors"), key=lambda p: p.stat().st_size)
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    return weights.relative_to(harness.root / "store" / harness.config.run_id).as_posix()


def test_corrupt_checkpoint_is_abandoned_and_newer_ones_refreshed(
        tmp_path: Path, redis_server, tiny_model, scifact_subset) -> None:
    harness = _prepare(tmp_path, redis_server.url, "corrupt-ckpt", scifact_subset, tiny_model,
                       {"pool": "in_batch", "warmup": "none"})
    bus = EventBus(connect(redis_server.url), harness.config.run_id)
    processes: dict[str, subprocess.Popen] = {"trainer": harness.spawn("trainer", "trainer")}
    try:
        wait_until(lambda: 6 in checkpoint_steps(bus, CheckpointPublished), 300,
                   "the trainer never published its last checkpoint")
        weights = _corrupt_weights(harness, 0)
        corrupted_at = time.time()
        processes["inferencer"] = harness.spawn("inferencer", "inferencer")
        processes["indexer"] = harness.spawn("indexer", "indexer")
        wait_until(lambda: 6 in checkpoint_steps(bus, EvalCompleted), 300,
                   "checkpoint 6 was never evaluated")
        wait_until(lambda: "checkpoint 0 abandoned" in harness.log("indexer"), 60,
                   "the indexer never abandoned checkpoint 0")
        for name in ("inferencer", "indexer"):
            assert processes[name].poll() is None, harness.log(name)
        failed = list(bus.history(ShardFailed))
        encoded = Counter(checkpoint_steps(bus, ShardEncoded))
        evaluated = checkpoint_steps(bus, EvalCompleted)
    finally:
        for process in processes.values():
            stop(process)

    assert {e.step for e in failed} == {0}
    assert all(e.event.attempt == MAX_ATTEMPTS for e in failed)
    assert all(weights in e.event.error and "sha256" in e.event.error for e in failed)
    assert len({e.event.key for e in failed}) == len(failed), "one give-up per item"
    assert encoded[0] == 0 and encoded[3] == 0 and encoded[6] > 0, encoded
    assert evaluated == [6], evaluated
    inferencer_log, indexer_log = harness.log("inferencer"), harness.log("indexer")
    assert f"after {MAX_ATTEMPTS} attempts" in inferencer_log
    assert indexer_log.count("checkpoint 0 abandoned") == 1
    assert "Traceback" not in inferencer_log + indexer_log

    six = next(e for e in bus.history(EvalCompleted) if e.step == 6)
    record_fault(
        "Corrupt checkpoint",
        f"{weights} truncated to half its bytes on disk after the trainer published 0, 3, 6 "
        f"(recorded sha256 kept)",
        f"each item of checkpoint 0 retried to inference.max_attempts ({MAX_ATTEMPTS}), then "
        "shard.failed naming the object; indexer abandoned checkpoint 0 once and built 6; no "
        "service exited",
        entry_ms(six.entry_id) / 1000 - corrupted_at,
        lost="checkpoint 0's refresh (its weights are unreadable)",
        items_given_up=len(failed))


def test_trainer_waiting_for_an_abandoned_checkpoint_stops_with_a_clear_error(
        tmp_path: Path, redis_server, tiny_model, scifact_subset) -> None:
    harness = _prepare(tmp_path, redis_server.url, "corrupt-first", scifact_subset, tiny_model,
                       {"pool": "ann", "warmup": "none", "top_k": 20})
    bus = EventBus(connect(redis_server.url), harness.config.run_id)
    processes = {"trainer": harness.spawn("trainer", "trainer")}
    try:
        wait_until(lambda: 0 in checkpoint_steps(bus, CheckpointPublished), 300,
                   "checkpoint 0 was never published")
        weights = _corrupt_weights(harness, 0)
        processes["inferencer"] = harness.spawn("inferencer", "inferencer")
        processes["indexer"] = harness.spawn("indexer", "indexer")
        code = processes["trainer"].wait(timeout=180)
        for name in ("inferencer", "indexer"):
            assert processes[name].poll() is None, harness.log(name)
    finally:
        for process in processes.values():
            stop(process)

    log = harness.log("trainer")
    assert code != 0, log[-3000:]
    assert "no first negatives: checkpoint 0 was abandoned" in log
    assert weights in log and "negatives.pool ann" in log
    published = checkpoint_steps(bus, CheckpointPublished)
    assert published == [0], "the trainer never took a step"
