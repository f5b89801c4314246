"""The embedded launcher restarts crashed services, as the kubelet restarts a pod.

A real embedded run (redis-server, trainer, two inferencer replicas, two index partitions,
each an OS process): an inferencer replica and index partition 1 are SIGKILLed in the middle
of checkpoint 0's refresh and the trainer right after checkpoint 3 is published and complete
(its training state stored, which follows the announcement). The run
completes, every refresh is announced once, the trainer resumes from checkpoint 3 and the
summary lists the three restarts. A service that crashes on every start (its gRPC port is
taken) stops the run once its restart budget is spent, naming it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from collections import Counter
from pathlib import Path

import pytest

from ance_train.config import load_config
from ance_train.infra.bus import EventBus, connect
from ance_train.launcher.embedded import EmbeddedRun, RunAborted, write_summary
from ance_train.protocol.events import (
    CheckpointPublished,
    EvalCompleted,
    NegativesReady,
    ShardEncoded,
)
from ance_train.trainer.checkpoints import latest_complete_checkpoint

from ance_train_dev.helpers import write_config
from ance_train_dev.service_harness import wait_until

STEPS = 6


def _config(tmp_path: Path, data: Path, model: Path, replicas: int = 2, partitions: int = 2,
            **services: object) -> Path:
    return write_config(
        tmp_path / "c.yaml", run_id="restarts", output_dir=str(tmp_path / "runs"),
        data={"path": str(data), "dev_fraction": 0.2},
        model={"path": str(model), "max_query_length": 16, "max_doc_length": 32},
        training={"steps": STEPS, "batch_size": 4, "refresh_every": 3, "torch_threads": 1},
        negatives={"pool": "ann", "warmup": "none", "top_k": 20, "wait_for_first": True},
        inference={"replicas": replicas, "shard_size": 50, "torch_threads": 1,
                   "claim_timeout_s": 3},
        index={"eval_depth": 50, "partitions": partitions},
        services={"restart": {"initial_backoff_s": 0.5, **services}},
        tracking={"report_to": []})


def _kill(run: EmbeddedRun, name: str) -> None:
    child = next(c for c in run.children if c.name == name)
    os.kill(child.process.pid, signal.SIGKILL)


def test_killed_services_are_restarted_and_the_run_completes(tmp_path: Path, scifact_subset,
                                                             tiny_model) -> None:
    path = _config(tmp_path, scifact_subset, tiny_model)
    run = EmbeddedRun(load_config(path), path)
    run.prepare()
    bus = EventBus(connect(run.redis_url), "restarts")
    killed: list[str] = []
    failures: list[BaseException] = []

    def nemesis() -> None:
        try:
            wait_until(lambda: any(e.step == 0 for e in bus.history(ShardEncoded)), 60,
                       "no shard of checkpoint 0 encoded", interval_s=0.05)
            for name in ("inferencer-0", "indexer-1"):
                _kill(run, name)
                killed.append(name)
            # Published (on its weights), then complete (its training state stored last).
            wait_until(lambda: any(e.step == 3 for e in bus.history(CheckpointPublished))
                       and latest_complete_checkpoint(run.store) == 3, 60,
                       "checkpoint 3 not published and complete", interval_s=0.05)
            _kill(run, "trainer")
            killed.append("trainer")
        except BaseException as error:  # reported by the test's thread
            failures.append(error)

    try:
        run.start_services()
        thread = threading.Thread(target=nemesis, daemon=True)
        thread.start()
        result = run.monitor()
        thread.join(timeout=5)
        announced = {t.__name__: Counter(e.step for e in bus.history(t))
                     for t in (NegativesReady, EvalCompleted)}
    finally:
        run.stop()
    write_summary(run.run_dir, result)
    assert not failures, failures
    assert killed == ["inferencer-0", "indexer-1", "trainer"]
    assert announced == {name: {0: 1, 3: 1, 6: 1} for name in announced}, announced
    trainer = result.trainer_summary
    assert trainer["finished"] and trainer["steps"] == STEPS
    assert trainer["resumed_from"] == [3]
    assert len(trainer["losses"]) == STEPS  # every step once: none lost, none twice

    summary = json.loads((run.run_dir / "summary.json").read_text())
    restarts = summary["restarts"]
    assert sorted(r["service"] for r in restarts) == sorted(killed), restarts
    for record in restarts:
        assert record["signal"] == "SIGKILL" and record["exit_code"] is None
        assert record["restarted_after_s"] >= record["backoff_s"] == 0.5
    for name in killed:  # the same name, port and log: appended to by the new process
        log = (run.run_dir / "logs" / f"{name}.log").read_text()
        assert log.count("object store ") >= 2, log[-2000:]
    assert all(c.process.poll() is not None for c in run.children)
    # services.warm_start (on by default): the trainer and the inferencers, restarted ones
    # included, were forked from a zygote (here the test process's warm-start server, even
    # after the earlier tests of this process changed its environment as libraries do);
    # the index partitions started cold.
    assert run.warm is not None and run.warm.shared
    started = {c.name: type(c.process).__name__ for c in run.children}
    assert started == {"trainer": "WarmProcess", "inferencer-0": "WarmProcess",
                       "inferencer-1": "WarmProcess", "indexer-0": "Popen",
                       "indexer-1": "Popen"}, started
    assert run.warm is not None and not run.warm.alive()  # closed with the run


def test_a_service_crashing_on_every_start_stops_the_run(tmp_path: Path, scifact_subset,
                                                         tiny_model) -> None:
    """The trainer's port is held by another socket: it cannot serve, on any start (and
    without a trainer the run cannot finish before the budget is spent). One inferencer and
    one index partition: more would only add processes to start."""
    with socket.create_server(("127.0.0.1", 0)) as squatter:
        port = squatter.getsockname()[1]
        path = _config(tmp_path, scifact_subset, tiny_model, replicas=1, partitions=1,
                       max_restarts=1, window_s=120)
        config = load_config(path)
        config = config.model_copy(update={"services": config.services.model_copy(
            update={"trainer_port": port})})
        run = EmbeddedRun(config, path)
        run.prepare()
        try:
            run.start_services()
            with pytest.raises(RunAborted) as aborted:
                for _ in run.refreshes():
                    pass
        finally:
            run.stop()
    message = str(aborted.value)
    assert message.startswith("trainer exited with code 1 and is not restarted: it "
                              "crashed 2 times within 120 s, more than "
                              "services.restart.max_restarts (1)"), message
    assert "last log lines" in message and str(port) in message
    assert [r["service"] for r in run.supervisor.records()] == ["trainer"]
    assert all(c.process.poll() is not None for c in run.children)
