"""The object store unreachable for 30 s in the middle of a refresh.

The services reach a real S3 server (moto, through the minio client) only through a loopback
TCP proxy (dev/ance_train_dev/tcp_proxy.py). While checkpoint 0's shards are being encoded the
proxy resets every open connection and every new one for 30 s; moto itself keeps running, so
its in-memory objects survive. Store calls must retry with backoff (S3Store: tenacity, up to
``ANCE_S3_RETRY_SECONDS``), no service may exit, and the run must complete with nothing lost.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from ance_train.infra.bus import EventBus, connect
from ance_train.protocol.events import ShardEncoded

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
from ance_train_dev.tcp_proxy import tcp_proxy

pytestmark = pytest.mark.fault

OUTAGE_S = 30.0
RETRY_S = 60.0  # longer than the outage: every call outlives it
RETRY_LINE = re.compile(r"^(\S+ \S+) .*S3 (?:put|get|list|stat) .* failed \(attempt (\d+),",
                        re.MULTILINE)


def test_object_store_unreachable_for_30s(tmp_path: Path, redis_server, s3_env, tiny_model,
                                          scifact_subset) -> None:
    host, port = s3_env["ANCE_S3_ENDPOINT"].split(":")
    with tcp_proxy(host, int(port)) as proxy:
        store_env = {**s3_env, "ANCE_S3_ENDPOINT": proxy.endpoint,
                     "ANCE_S3_RETRY_SECONDS": str(RETRY_S)}
        harness = Harness.prepare(tmp_path, redis_server.url, store_env=store_env,
                                  **run_sections("store-outage", scifact_subset, tiny_model))
        bus = EventBus(connect(redis_server.url), harness.config.run_id)
        run = ServiceRun.start(harness)
        try:
            encoded, total = wait_mid_refresh(bus, 0, timeout_s=120)
            proxy.cut()
            time.sleep(OUTAGE_S)
            run.assert_alive()
            rejected = proxy.rejected
            proxy.restore()
            restored_ms, restored = int(time.time() * 1000), time.monotonic()
            run.wait_finished(bus, timeout_s=240)
            finished_after_s = time.monotonic() - restored
            counts = assert_nothing_lost(harness, bus)
            run.assert_alive()
        finally:
            run.stop()

    assert rejected > 0, "the services must have tried the store during the outage"
    retries = {name: [int(a) for _, a in RETRY_LINE.findall(harness.log(name))]
               for name in run.processes}
    assert retries["inferencer-0"] and retries["inferencer-1"], retries
    # Exponential backoff (0.25 s doubling to 8 s): a handful of attempts per call across
    # 30 s, not a tight loop, and none of them gave up.
    longest = max(a for attempts in retries.values() for a in attempts)
    assert 4 <= longest <= 15, retries
    for name in run.processes:
        log = harness.log(name)
        assert "retried for up to" not in log and "left for redelivery" not in log, name
    first = first_entry_after(bus, (ShardEncoded,), restored_ms)
    assert first is not None
    recovery_s = (entry_ms(first.entry_id) - restored_ms) / 1000
    record_fault(
        "Object store unreachable for 30 s",
        f"loopback TCP proxy in front of the S3 server (moto) resets every connection for "
        f"{OUTAGE_S:g} s, with {encoded}/{total} shards of checkpoint 0 encoded",
        f"S3 calls retried with exponential backoff (up to attempt {longest}, "
        f"{rejected} connections refused), none gave up; no service exited; run completed",
        recovery_s, lost="nothing", outage_s=OUTAGE_S,
        run_finished_after_restore_s=round(finished_after_s, 1), **counts)
