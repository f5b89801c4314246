"""Redis SIGKILLed in the middle of a refresh and restarted on the same port and directory.

Trainer, two inferencers and the indexer run as OS processes against a real redis-server with
append-only persistence (``appendfsync always``, see ``ance_train/launcher/redis_server.py``). While
checkpoint 0's shards are still pending, Redis is killed with SIGKILL and started again a few
seconds later from its AOF. Every service must ride out the outage (none exits), reconnect
with backoff, and the run must finish with nothing lost.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ance_train.infra.bus import EventBus, connect
from ance_train.launcher.ports import free_port
from ance_train.launcher.redis_server import RedisServer
from ance_train.protocol.events import CheckpointPublished, NegativesReady, ShardEncoded

from ance_train_dev.fault_report import record_fault
from ance_train_dev.fault_run import (
    ServiceRun,
    assert_nothing_lost,
    entry_ms,
    first_entry_after,
    run_sections,
    wait_mid_refresh,
)
from ance_train_dev.service_harness import Harness

pytestmark = pytest.mark.fault

OUTAGE_S = 5.0


def test_redis_killed_mid_refresh_restarts_from_aof(tmp_path: Path, tiny_model,
                                                    scifact_subset) -> None:
    redis_dir, port = tmp_path / "redis", free_port()
    server = RedisServer(redis_dir, port=port).start()
    harness = Harness.prepare(tmp_path, server.url,
                              **run_sections("redis-restart", scifact_subset, tiny_model))
    bus = EventBus(connect(server.url), harness.config.run_id)
    run = ServiceRun.start(harness)
    try:
        encoded, total = wait_mid_refresh(bus, 0, timeout_s=120)
        server.process.kill()  # SIGKILL: no shutdown, no final AOF rewrite
        server.process.wait()
        time.sleep(OUTAGE_S)
        run.assert_alive()  # nobody gave up while Redis was gone
        server = RedisServer(redis_dir, port=port).start()
        restarted_ms, restarted = int(time.time() * 1000), time.monotonic()

        run.wait_finished(bus, timeout_s=240)
        finished_after_s = time.monotonic() - restarted
        counts = assert_nothing_lost(harness, bus)
        run.assert_alive()
        assert run.exited() == {"trainer": 0}
        recovery_s = assert_each_service_used_the_new_server(harness, bus, restarted_ms)
    finally:
        run.stop()
        server.stop()

    record_fault(
        "Redis killed mid-refresh, restarted",
        f"SIGKILL redis-server with {encoded}/{total} shards of checkpoint 0 encoded; "
        f"restart on the same port and AOF directory after {OUTAGE_S:g} s",
        "no service exited; clients reconnected with backoff; consumer groups and pending "
        "items came back from the AOF; the refresh and the run completed",
        recovery_s, lost="nothing", outage_s=OUTAGE_S,
        run_finished_after_restart_s=round(finished_after_s, 1), **counts)


def assert_each_service_used_the_new_server(harness: Harness, bus: EventBus,
                                            restarted_ms: int) -> float:
    """Every service published after the restart; returns seconds from the restart to the
    first entry any of them wrote."""
    checkpoint = first_entry_after(bus, (CheckpointPublished,), restarted_ms)
    assert checkpoint is not None and checkpoint.step == harness.config.training.steps
    negatives = first_entry_after(bus, (NegativesReady,), restarted_ms)
    assert negatives is not None and negatives.step == 0
    replicas = {e.event.instance for e in bus.history(ShardEncoded)
                if entry_ms(e.entry_id) >= restarted_ms}
    assert replicas == {"inferencer-0", "inferencer-1"}
    first = first_entry_after(bus, (ShardEncoded, NegativesReady,
                                    CheckpointPublished), restarted_ms)
    assert first is not None
    return (entry_ms(first.entry_id) - restarted_ms) / 1000
