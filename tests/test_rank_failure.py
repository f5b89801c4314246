"""Fault: a data-parallel trainer rank is SIGKILLed; torchrun restarts the group, which resumes.

The trainer runs as two gloo ranks under ``python -m torch.distributed.run --max-restarts 2``
(the command ``ance-train run`` uses, ``launcher/embedded.py``); the indexer and an inferencer
are OS processes of their own, against a real Redis and a local store. Rank 1 is killed some
steps after checkpoint 10, then rank 0 — the rank holding the gRPC server, the negatives feed
and the publisher — some steps after checkpoint 20. Each time torchrun stops the surviving
rank and starts both again; they resume from the newest complete checkpoint. The other
services keep running throughout (same processes), every checkpoint is published once and
evaluated, and the summary records every step once.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from ance_train.infra.bus import EventBus, connect
from ance_train.infra.rpc import fetch_status
from ance_train.infra.store import ObjectStore
from ance_train.launcher.embedded import service_command
from ance_train.launcher.ports import free_port
from ance_train.protocol import keys
from ance_train.protocol.events import CheckpointPublished, EvalCompleted, NegativesReady
from ance_train.trainer.checkpoints import latest_complete_checkpoint

from ance_train_dev.fault_report import record_fault
from ance_train_dev.ranks import rank_process
from ance_train_dev.service_harness import Harness, checkpoint_steps, stop, wait_until

pytestmark = pytest.mark.fault

STEPS, REFRESH = 30, 10
CHECKPOINTS = [0, 10, 20, 30]


def _rank_process(torchrun: subprocess.Popen, rank: int) -> psutil.Process:
    """The worker torchrun started as ``rank`` (its ``RANK`` variable)."""
    return wait_until(lambda: rank_process(torchrun.pid, rank), 60, f"torchrun's rank {rank}")


def _after(text: str, marker: str) -> str:
    """What ``text`` holds after ``marker`` ('' without it)."""
    return text.partition(marker)[2]


def _trainer_step(bus: EventBus) -> int:
    address = bus.services().get("trainer:trainer")
    if address is None:
        return -1
    try:
        return fetch_status(address, timeout_s=1.0).step
    except Exception:  # not serving (yet, or any more)
        return -1


def _kill_after(bus: EventBus, store: ObjectStore, torchrun: subprocess.Popen, rank: int,
                checkpoint: int, steps_past: int = 2) -> tuple[int, int]:
    """SIGKILL ``rank`` once the trainer is ``steps_past`` steps beyond the published and
    complete ``checkpoint`` (its training state is stored after the announcement); returns
    the step it was at and the killed pid."""
    def past() -> int:
        step = _trainer_step(bus)
        published = checkpoint in checkpoint_steps(bus, CheckpointPublished)
        complete = (latest_complete_checkpoint(store) or -1) >= checkpoint
        return step if published and complete and step >= checkpoint + steps_past else 0

    step = wait_until(past, 180, f"the trainer never got past checkpoint {checkpoint}",
                      interval_s=0.05)
    assert step < STEPS, "the run finished before the rank could be killed"
    victim = _rank_process(torchrun, rank)
    victim.send_signal(signal.SIGKILL)
    victim.wait(30)
    return step, victim.pid


def test_killed_ranks_restart_the_group_from_the_last_checkpoint(
        tmp_path: Path, redis_server, tiny_model, scifact_subset) -> None:
    harness = Harness.prepare(
        tmp_path, redis_server.url, run_id="rank-failure",
        data={"path": str(scifact_subset), "dev_fraction": 0.2},
        model={"path": str(tiny_model), "max_query_length": 16, "max_doc_length": 32},
        training={"steps": STEPS, "batch_size": 8, "refresh_every": REFRESH,
                  "warmup_steps": 2, "learning_rate": 1e-4, "torch_threads": 1,
                  "processes": 2, "max_restarts": 2},
        negatives={"pool": "ann", "per_query": 2, "warmup": "none", "top_k": 30},
        inference={"shard_size": 100, "claim_timeout_s": 10, "torch_threads": 1},
        index={"eval_depth": 100},
    )
    bus = EventBus(connect(redis_server.url), harness.config.run_id)
    others = [harness.spawn("indexer", "indexer"), harness.spawn("inferencer", "inferencer")]
    config = harness.config.training
    launch = service_command("trainer", config.processes, config.max_restarts)
    command = [*launch.argv, "serve", "trainer", "--config", str(harness.config_path),
               "--instance", "trainer", "--work-dir", str(harness.root / "work" / "trainer"),
               "--port", str(port := free_port())]  # every rank 0 binds this port
    with open(harness.root / "trainer.log", "ab") as log:
        torchrun = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                    env={**harness.env(), **launch.env})
    try:
        step_1, killed_1 = _kill_after(bus, harness.store, torchrun, 1, REFRESH)
        killed_at = time.monotonic()
        # The group comes back (new rank processes) and trains past the checkpoint again.
        wait_until(lambda: f"step {REFRESH + 1} loss" in _after(harness.log("trainer"),
                                                                "group restart 1"),
                   120, "the restarted group never ran a step")
        recovery_s = time.monotonic() - killed_at
        step_0, killed_0 = _kill_after(bus, harness.store, torchrun, 0, 2 * REFRESH)
        assert torchrun.wait(timeout=240) == 0, harness.log("trainer")[-4000:]
        wait_until(lambda: STEPS in checkpoint_steps(bus, EvalCompleted), 120,
                   "the final checkpoint was never evaluated")
        # The indexer and the inferencer never noticed: the same processes, still running.
        assert [p.poll() for p in others] == [None, None]
    finally:
        stop(torchrun)
        for process in others:
            stop(process)

    log = harness.log("trainer")
    assert "group restart 1" in log and "group restart 2" in log and "group restart 3" not in log
    assert f"resuming from checkpoint {REFRESH}" in log
    assert f"resuming from checkpoint {2 * REFRESH}" in log
    # Every line a rank logs says which rank it is.
    assert re.search(r"trainer\[trainer rank 1/2\]", log)
    assert "SignalException" not in log
    assert log.count(f"gRPC on 127.0.0.1:{port}") == 3  # each new rank 0 bound it again

    summary = harness.store.get_json(keys.TRAINER_SUMMARY)
    assert summary["finished"] and summary["steps"] == STEPS
    assert summary["resumed_from"] == [REFRESH, 2 * REFRESH]
    assert summary["checkpoints"] == CHECKPOINTS
    for name in ("losses", "async_gaps", "negatives_steps", "step_seconds", "dual_losses"):
        assert len(summary[name]) == STEPS, name  # one entry per step, none twice or missing
    # A redone step's record is the redone one (the first group logged steps 1 and 10 only).
    for restart, step in ((1, REFRESH + 1), (2, 2 * REFRESH + 1)):
        logged = re.search(rf"step {step} loss (\S+)", _after(log, f"group restart {restart}"))
        assert logged and f"{summary['losses'][step - 1]:.4f}" == logged.group(1), step
    swap_steps = [swap["step"] for swap in summary["swaps"]]
    assert swap_steps == sorted(set(swap_steps)), "swap records out of order or repeated"
    # Published once each (a restart resumes from a published checkpoint and never
    # republishes it); every refresh announced completed.
    assert checkpoint_steps(bus, CheckpointPublished) == CHECKPOINTS
    assert sorted(set(checkpoint_steps(bus, EvalCompleted))) == CHECKPOINTS
    assert set(checkpoint_steps(bus, NegativesReady)) == set(CHECKPOINTS)
    assert killed_1 != killed_0
    record_fault("trainer rank killed", f"SIGKILL rank 1 {step_1 - REFRESH} steps after "
                 f"checkpoint {REFRESH}, then rank 0 {step_0 - 2 * REFRESH} steps after "
                 f"checkpoint {2 * REFRESH} (2 ranks, torchrun --max-restarts 2)",
                 f"torchrun restarted the group twice; resumed from {REFRESH} and "
                 f"{2 * REFRESH}, finished {STEPS} steps, no checkpoint republished, indexer "
                 "and inferencer untouched", recovery_s,
                 lost="the steps since the last checkpoint, redone",
                 test="tests/test_rank_failure.py")


def test_ranks_die_with_their_torchrun_agent(tmp_path: Path, redis_server, tiny_model,
                                             scifact_subset) -> None:
    """torchrun's agent SIGKILLed (its launcher or pod killed hard) while both ranks wait —
    rank 0 for its first negatives (no indexer runs), rank 1 in a collective, where a SIGTERM
    would never be seen: the kernel kills both ranks (PDEATHSIG) instead of leaving them
    waiting for the 6-hour rank timeout."""
    harness = Harness.prepare(
        tmp_path, redis_server.url, run_id="rank-orphans",
        data={"path": str(scifact_subset), "dev_fraction": 0.2},
        model={"path": str(tiny_model), "max_query_length": 16, "max_doc_length": 32},
        training={"steps": 4, "batch_size": 8, "refresh_every": 2, "warmup_steps": 1,
                  "torch_threads": 1, "processes": 2},
        negatives={"pool": "ann", "per_query": 1, "warmup": "none"})
    launch = service_command("trainer", 2)
    command = [*launch.argv, "serve", "trainer", "--config",
               str(harness.config_path), "--instance", "trainer",
               "--work-dir", str(harness.root / "work" / "trainer")]
    with open(harness.root / "trainer.log", "ab") as log:
        torchrun = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                    env={**harness.env(), **launch.env})
    try:
        ranks = [_rank_process(torchrun, rank) for rank in (0, 1)]
        wait_until(lambda: "waiting for first negatives" in harness.log("trainer")
                   or checkpoint_steps(EventBus(connect(redis_server.url), "rank-orphans"),
                                       CheckpointPublished) == [0],
                   120, "rank 0 never published checkpoint 0")
        torchrun.send_signal(signal.SIGKILL)
        torchrun.wait(30)
        _, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, f"ranks outlived their agent: {[p.pid for p in alive]}"
    finally:
        stop(torchrun)
