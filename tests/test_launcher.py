"""`ance-train run`: errors before any work, and Ctrl-C leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from ance_train.launcher.warm_start import SERVER_VAR

from ance_train_dev.helpers import write_config
from ance_train_dev.service_harness import processes_mentioning, registered_services, wait_until


def ance(*args: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ance_train.cli", *args], capture_output=True,
                          text=True, env=env, timeout=120, **kwargs)


def base_config(root: Path, data: Path, model: Path, **training) -> dict:
    return {"run_id": "launch", "output_dir": str(root / "runs"),
            "data": {"path": str(data)},
            "model": {"path": str(model), "max_query_length": 16, "max_doc_length": 32},
            "training": {"steps": 100000, "batch_size": 4, "refresh_every": 1000,
                         "torch_threads": 1, **training},
            "negatives": {"warmup": "none"},
            "inference": {"replicas": 2, "shard_size": 100, "torch_threads": 1}}


def test_unknown_config_field_fails_before_anything_starts(tmp_path: Path, scifact_subset,
                                                           tiny_model) -> None:
    config = base_config(tmp_path, scifact_subset, tiny_model, stpes=3)
    result = ance("run", "--config", str(write_config(tmp_path / "c.yaml", **config)))
    assert result.returncode == 2
    assert "training.stpes" in result.stderr and "unknown field" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_bad_data_keeps_the_previous_run_intact(tmp_path: Path, scifact_subset,
                                                tiny_model) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("corpus.jsonl", "queries.jsonl"):
        (broken / name).write_text((scifact_subset / name).read_text())
    (broken / "qrels").mkdir()
    rows = (scifact_subset / "qrels" / "train.tsv").read_text().splitlines()
    (broken / "qrels" / "train.tsv").write_text("\n".join([*rows[:3], "q-x\tnope\t1"]) + "\n")
    previous = tmp_path / "runs" / "launch"
    previous.mkdir(parents=True)
    (previous / "precious.txt").write_text("results of an earlier run")

    config = base_config(tmp_path, broken, tiny_model)
    result = ance("run", "--config", str(write_config(tmp_path / "c.yaml", **config)),
                  "--overwrite")
    assert result.returncode == 1
    assert "train.tsv line 4" in result.stderr
    assert (previous / "precious.txt").read_text() == "results of an earlier run"

    config = base_config(tmp_path, scifact_subset, tiny_model)
    result = ance("run", "--config", str(write_config(tmp_path / "c.yaml", **config)))
    assert result.returncode == 1 and "already exists" in result.stderr
    assert (previous / "precious.txt").exists()


def test_errors_are_not_wrapped_at_the_terminal_width(tmp_path: Path, scifact_subset,
                                                       tiny_model) -> None:
    """A long path and what is said about it stay on one line (stderr is not a TTY here, so
    a wrapping console would break it at 80 columns)."""
    deep = tmp_path / ("d" * 120)
    previous = deep / "runs" / "launch"
    previous.mkdir(parents=True)
    (previous / "summary.json").write_text("{}")
    config = base_config(deep, scifact_subset, tiny_model)
    result = ance("run", "--config", str(write_config(deep / "c.yaml", **config)))
    assert result.returncode == 1
    assert f"error: run directory {previous} already exists; pass --overwrite" in result.stderr


def test_ctrl_c_stops_every_service_and_redis(tmp_path: Path, scifact_subset,
                                              tiny_model) -> None:
    config_path = write_config(tmp_path / "c.yaml",
                               **base_config(tmp_path, scifact_subset, tiny_model))
    run_dir = tmp_path / "runs" / "launch"
    # With ANCE_REDIS_PASSWORD in the shell, the run's private Redis requires it.
    env = dict(os.environ, ANCE_REDIS_PASSWORD="launcher-test-secret")
    # A zygote of the run's own, as a user's run has (not the test process's warm-start
    # server, which the suite's other runs share): it too must stop with the run.
    env.pop(SERVER_VAR, None)
    # Started with SIGINT ignored, as a shell starts a background job (`cmd &` in a script):
    # the launcher must still stop on it.
    launcher = subprocess.Popen([sys.executable, "-m", "ance_train.cli", "run", "--config",
                                 str(config_path)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env,
                                preexec_fn=_ignore_sigint)

    def all_services_up() -> bool:
        if len(registered_services(run_dir, "launch", "launcher-test-secret")) < 4:
            return False  # not yet: spare a call of the CLI
        reply = ance("status", "--config", str(config_path), "--json", env=env)
        rows = json.loads(reply.stdout) if reply.returncode == 0 else []
        return len(rows) == 4 and all(r["state"] != "unreachable" for r in rows)

    wait_until(all_services_up, 90, "services did not come up", interval_s=0.5)
    endpoints = (run_dir / "endpoints.json").read_text()
    assert "launcher-test-secret" not in endpoints
    redis_url = json.loads(endpoints)["redis_url"]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(redis_url).ping()  # no password: refused
    port = redis_url.rsplit(":", 1)[1]
    redis_marker = f"127.0.0.1:{port.split('/')[0]}"  # redis-server rewrites its title
    children = processes_mentioning(str(run_dir)) + processes_mentioning(redis_marker)
    # redis + trainer + indexer + 2 inferencers + the zygote they were forked from
    assert len(children) == 6, children
    assert sum("ance_train.launcher.zygote" in c for c in children) == 1, children
    launcher.send_signal(signal.SIGINT)
    _, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 130, stderr
    assert "all services stopped" in stderr
    time.sleep(0.5)
    assert processes_mentioning(str(run_dir)) == [], "orphan services after Ctrl-C"
    assert processes_mentioning(redis_marker) == [], "redis-server left running after Ctrl-C"


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
