"""A service asked to stop ends within its grace period even when its stop waits on a
dependency that is gone (infra/process.py: exit_after_grace). Seen when an embedded launcher
was killed: PDEATHSIG asked its inferencers to stop while Redis and the store died with the
launcher, and they retried as orphans for minutes. A real inferencer process and Redis."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from ance_train.infra.bus import EventBus, connect
from ance_train.infra.process import TERMINATION_GRACE_VAR, termination_grace_s
from ance_train.infra.rpc import fetch_status

from ance_train_dev.service_harness import Harness, stop, wait_registered, wait_until

GRACE_S = 3.0


def test_a_service_whose_redis_is_gone_exits_within_its_grace_period(
        tmp_path: Path, redis_server, tiny_model, scifact_subset) -> None:
    harness = Harness.prepare(
        tmp_path, redis_server.url, run_id="grace",
        data={"path": str(scifact_subset), "dev_fraction": 0.2},
        model={"path": str(tiny_model), "max_query_length": 16, "max_doc_length": 32},
        inference={"shard_size": 100, "torch_threads": 1})
    bus = EventBus(connect(redis_server.url), "grace")
    inferencer = harness.spawn("inferencer", "inferencer",
                               {TERMINATION_GRACE_VAR: str(GRACE_S)})
    try:
        wait_registered(harness, bus, inferencer, "inferencer", "inferencer")
        # In its claim loop (after importing the model code): what it does next is Redis's.
        address = bus.services()["inferencer:inferencer"]
        wait_until(lambda: fetch_status(address, timeout_s=1.0).progress.phase
                   == "waiting for work", 120, "the inferencer waiting for work")
        redis_server.process.kill()  # gone, as with a killed launcher
        redis_server.process.wait()
        time.sleep(1.0)  # the service is now retrying Redis
        inferencer.send_signal(signal.SIGTERM)
        asked = time.monotonic()
        code = inferencer.wait(timeout=GRACE_S + 20)
        took = time.monotonic() - asked
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {GRACE_S + 20}s after SIGTERM:\n"
                    f"{harness.log('inferencer')[-3000:]}")
    finally:
        stop(inferencer)
    log = harness.log("inferencer")
    assert code == 128 + signal.SIGTERM, log[-3000:]
    assert took >= GRACE_S - 0.5, took
    assert "still running 3s after the request to stop" in log, log[-3000:]


def test_the_grace_period_is_read_from_the_environment(monkeypatch) -> None:
    """Logic only: the variable's parsing."""
    monkeypatch.delenv(TERMINATION_GRACE_VAR, raising=False)
    assert termination_grace_s() == 30.0
    monkeypatch.setenv(TERMINATION_GRACE_VAR, "2.5")
    assert termination_grace_s() == 2.5
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv(TERMINATION_GRACE_VAR, bad)
        with pytest.raises(ValueError, match=f"{TERMINATION_GRACE_VAR}='{bad}'"):
            termination_grace_s()
