"""Fault: the trainer is SIGKILLed some steps after checkpoint N; a new trainer process resumes.

Trainer, inferencer and indexer run as OS processes against a real Redis and a local store.
The restarted trainer has a new instance name and an empty work directory (a rescheduled
pod): everything it resumes from comes from the store and the streams.
"""

from __future__ import annotations

import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from ance_train.infra.bus import EventBus, connect
from ance_train.infra.rpc import fetch_status
from ance_train.protocol import keys
from ance_train.protocol.events import CheckpointPublished
from ance_train.trainer.checkpoints import latest_complete_checkpoint

from ance_train_dev.fault_report import record_fault
from ance_train_dev.service_harness import Harness, stop, wait_until

pytestmark = pytest.mark.fault

STEPS, REFRESH = 50, 20
WINDOW = 10  # losses of the last steps before checkpoint N: the reference range


def _status_step(bus: EventBus, service: str) -> int:
    address = bus.services().get(service)
    if address is None:
        return -1
    try:
        return fetch_status(address).step
    except Exception:  # not serving yet
        return -1


def _published(bus: EventBus) -> list[int]:
    return [e.step for e in bus.history(CheckpointPublished)]


def test_killed_trainer_resumes_from_its_last_checkpoint(tmp_path: Path, redis_server,
                                                         tiny_model, scifact_subset) -> None:
    harness = Harness.prepare(
        tmp_path, redis_server.url, run_id="trainer-restart",
        data={"path": str(scifact_subset), "dev_fraction": 0.2},
        model={"path": str(tiny_model), "max_query_length": 16, "max_doc_length": 64},
        training={"steps": STEPS, "batch_size": 8, "refresh_every": REFRESH,
                  "warmup_steps": 5, "learning_rate": 1e-4, "torch_threads": 1},
        negatives={"pool": "ann", "per_query": 2, "warmup": "none", "top_k": 30},
        inference={"shard_size": 100, "claim_timeout_s": 10, "torch_threads": 1},
        index={"eval_depth": 100},
    )
    bus = EventBus(connect(redis_server.url), harness.config.run_id)
    processes = [harness.spawn("indexer", "indexer"), harness.spawn("inferencer", "inferencer")]
    first = harness.spawn("trainer", "trainer")
    processes.append(first)
    try:
        def steps_past_checkpoint() -> int:
            step = _status_step(bus, "trainer:trainer")
            # Published, and complete: its training state is stored after the event.
            complete = (latest_complete_checkpoint(harness.store) or -1) >= REFRESH
            return step if step >= REFRESH + 3 and REFRESH in _published(bus) and complete else 0

        step_at_kill = wait_until(steps_past_checkpoint, 240,
                                  f"the trainer never got 3 steps past checkpoint {REFRESH}")
        first.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        first.wait()
        resume_step = latest_complete_checkpoint(harness.store)
        assert resume_step == max(_published(bus)) and resume_step in (REFRESH, 2 * REFRESH)
        assert resume_step < step_at_kill  # steps after the checkpoint are lost

        shutil.rmtree(harness.root / "work" / "trainer")  # a fresh pod: nothing local survives
        second = harness.spawn("trainer", "trainer-2")
        processes.append(second)
        first_step = f"step {resume_step + 1} loss"
        wait_until(lambda: first_step in harness.log("trainer-2"), 240,
                   "the restarted trainer never ran a step")
        recovery_s = time.monotonic() - killed_at
        assert second.wait(timeout=300) == 0, harness.log("trainer-2")[-3000:]
    finally:
        for process in processes:
            stop(process)

    log = harness.log("trainer-2")
    assert f"resuming from checkpoint {resume_step}" in log
    logged_steps = [int(s) for s in re.findall(r"step (\d+) loss", log)]
    assert logged_steps[0] == resume_step + 1 and logged_steps[-1] == STEPS
    assert _published(bus) == [0, REFRESH, 2 * REFRESH, STEPS], "a checkpoint was republished"

    summary = harness.store.get_json(keys.TRAINER_SUMMARY)
    assert summary["finished"] and summary["steps"] == STEPS
    assert summary["resumed_from"] == [resume_step]
    assert summary["checkpoints"] == [0, REFRESH, 2 * REFRESH, STEPS]
    for name in ("losses", "async_gaps", "negatives_steps", "step_seconds"):
        assert len(summary[name]) == STEPS, name  # one entry per step, none twice or missing
    swap_steps = [swap["step"] for swap in summary["swaps"]]
    assert swap_steps == sorted(set(swap_steps)), "swap records out of order or repeated"
    losses = summary["losses"]
    before, after = losses[resume_step - WINDOW:resume_step], losses[resume_step:resume_step + 3]
    margin = max(before) - min(before) + 0.1  # one spread of noise on either side
    assert min(before) - margin <= min(after) and max(after) <= max(before) + margin, (
        before, after)
    record_fault("trainer killed", f"SIGKILL {step_at_kill - resume_step} steps after "
                 f"checkpoint {resume_step}", f"resumed from checkpoint {resume_step}, "
                 f"finished {STEPS} steps, no checkpoint republished", recovery_s,
                 lost=f"{step_at_kill - resume_step} steps after checkpoint {resume_step}, redone",
                 test="tests/test_trainer_restart.py")

