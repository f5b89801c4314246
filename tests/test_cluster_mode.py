"""Cluster mode and credentials: a service refuses to start without its credentials (before it
connects anywhere), authenticates to a real ``requirepass`` Redis with ``ANCE_REDIS_PASSWORD``,
fails clearly on a wrong password, and never writes a secret to its log."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ance_train.infra.bus import EventBus, connect
from ance_train.infra.credentials import redact_url
from ance_train.launcher.redis_server import RedisServer

from ance_train_dev.service_harness import Harness, stop, wait_registered

S3_SECRET = "s3-secret-2b7d90aa41"
CREDENTIALS = ("ANCE_REDIS_PASSWORD", "ANCE_S3_ENDPOINT", "ANCE_S3_ACCESS_KEY",
               "ANCE_S3_SECRET_KEY")


@contextlib.contextmanager
def listener() -> Iterator[tuple[str, socket.socket]]:
    """A loopback TCP port that accepts nothing by itself: any connection attempt queues."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        sock.setblocking(False)
        yield f"127.0.0.1:{sock.getsockname()[1]}", sock


def was_contacted(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def serve(role: str, env: dict[str, str], config: Path, work: Path,
          timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ance_train.cli", "serve", role, "--config", str(config),
         "--work-dir", str(work)], capture_output=True, text=True, env=env, timeout=timeout_s)


def base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ANCE_")}


@pytest.fixture
def config_path(tmp_path: Path, tiny_model: Path, scifact_subset: Path) -> Path:
    from ance_train_dev.helpers import write_config

    return write_config(tmp_path / "config.yaml", run_id="cluster-mode",
                        data={"path": str(scifact_subset)},
                        model={"path": str(tiny_model)})


@pytest.mark.parametrize(("present", "missing"), [
    ((), CREDENTIALS),
    (("ANCE_REDIS_PASSWORD", "ANCE_S3_ENDPOINT"), ("ANCE_S3_ACCESS_KEY", "ANCE_S3_SECRET_KEY")),
])
def test_cluster_mode_without_credentials_fails_before_connecting(
        tmp_path: Path, config_path: Path, present: tuple[str, ...],
        missing: tuple[str, ...]) -> None:
    with listener() as (redis_address, redis_sock), listener() as (s3_address, s3_sock):
        values = {"ANCE_REDIS_PASSWORD": "pw-given", "ANCE_S3_ENDPOINT": s3_address,
                  "ANCE_S3_ACCESS_KEY": "ak-given", "ANCE_S3_SECRET_KEY": S3_SECRET}
        env = {**base_env(), "ANCE_CLUSTER_MODE": "1",
               "ANCE_REDIS_URL": f"redis://{redis_address}/0",
               **{name: values[name] for name in present}}
        started = time.monotonic()
        for command in (["serve", "trainer"], ["prepare"]):
            result = subprocess.run(
                [sys.executable, "-m", "ance_train.cli", *command, "--config", str(config_path)],
                capture_output=True, text=True, env=env, timeout=60)
            assert result.returncode == 2, result.stderr
            for name in missing:
                assert name in result.stderr, (name, result.stderr)
            for name in present:
                assert name not in result.stderr, (name, result.stderr)
        assert time.monotonic() - started < 40  # two interpreter starts, nothing waited for
        assert not was_contacted(redis_sock)
        assert not was_contacted(s3_sock)


@pytest.mark.parametrize(("settings", "named"), [
    ({"ANCE_METRICS_PORT": "metrics"}, "ANCE_METRICS_PORT"),
    ({"ANCE_METRICS_PORT": "70000"}, "ANCE_METRICS_PORT"),
    # not in a pod: the namespace and the API URL must be given
    ({"ANCE_ANCERUN": "my-run"}, "ANCE_K8S_NAMESPACE"),
    ({"ANCE_ANCERUN": "my-run", "ANCE_K8S_NAMESPACE": "ml"}, "ANCE_KUBE_API"),
    ({"ANCE_ANCERUN": "My_Run", "ANCE_K8S_NAMESPACE": "ml"}, "ANCE_ANCERUN"),
    ({"ANCE_CLUSTER_MODE": "maybe"}, "ANCE_CLUSTER_MODE"),
    ({"ANCE_DATASET_TIMEOUT_S": "soon"}, "ANCE_DATASET_TIMEOUT_S"),
    ({"ANCE_GRPC_TLS": "1"}, "ANCE_GRPC_TLS_CA is required"),
    ({"ANCE_REDIS_TLS_CA": "/etc/ance-tls/redis/ca.crt"}, "not rediss://"),
])
def test_bad_settings_are_named_before_connecting(tmp_path: Path, config_path: Path,
                                                  settings: dict[str, str], named: str) -> None:
    with listener() as (redis_address, redis_sock):
        env = {**base_env(), "ANCE_REDIS_URL": f"redis://{redis_address}/0",
               "ANCE_STORE_DIR": str(tmp_path / "store"), **settings}
        result = serve("indexer", env, config_path, tmp_path / "work")
        assert result.returncode == 2
        assert named in result.stderr
        assert not was_contacted(redis_sock)


@pytest.fixture
def published(tmp_path: Path, redis_with_password: RedisServer, s3_env: dict[str, str],
              tiny_model: Path, scifact_subset: Path) -> Harness:
    """The dataset index of run ``cluster-auth`` in the (moto) S3 store."""
    store_env = {**s3_env, "ANCE_S3_SECRET_KEY": S3_SECRET}
    return Harness.prepare(tmp_path, f"redis://127.0.0.1:{redis_with_password.port}/0",
                           store_env=store_env, run_id="cluster-auth",
                           data={"path": str(scifact_subset)},
                           model={"path": str(tiny_model)},
                           inference={"torch_threads": 1})


def test_service_authenticates_with_the_password_and_logs_no_secret(
        published: Harness, redis_with_password: RedisServer) -> None:
    password = redis_with_password.password
    process = published.spawn("inferencer", "inf-auth", {
        "ANCE_CLUSTER_MODE": "1", "ANCE_REDIS_PASSWORD": password})
    bus = EventBus(connect(published.redis_url, password),
                          published.config.run_id)
    try:
        wait_registered(published, bus, process, "inferencer", "inf-auth")
        for given, code in ((password, 0), ("wrong-password-91", 1)):  # the CLI's client too
            status = subprocess.run(
                [sys.executable, "-m", "ance_train.cli", "status", "--json", "--redis-url",
                 published.redis_url, "--run-id", published.config.run_id],
                capture_output=True, text=True, timeout=120,
                env={**base_env(), "ANCE_REDIS_PASSWORD": given})
            assert status.returncode == code, status.stderr
            if code == 0:
                assert '"service": "inferencer:inf-auth"' in status.stdout
            else:
                assert "Redis refused authentication" in status.stderr
    finally:
        stop(process)
    log = published.log("inf-auth")
    assert f"Redis redis://127.0.0.1:{redis_with_password.port}/0" in log
    assert "S3Store(" in log
    assert password not in log and S3_SECRET not in log


def test_password_in_the_url_is_redacted_in_the_log(published: Harness,
                                                    redis_with_password: RedisServer) -> None:
    password = redis_with_password.password
    url = f"redis://:{password}@127.0.0.1:{redis_with_password.port}/0"
    process = published.spawn("inferencer", "inf-url", {"ANCE_REDIS_URL": url})
    bus = EventBus(connect(published.redis_url, password),
                          published.config.run_id)
    try:
        wait_registered(published, bus, process, "inferencer", "inf-url")
    finally:
        stop(process)
    log = published.log("inf-url")
    assert f"Redis redis://***@127.0.0.1:{redis_with_password.port}/0" in log
    assert password not in log and S3_SECRET not in log


@pytest.mark.parametrize("given", ["wrong-password-5e2a", None])
def test_refused_password_fails_at_once_and_clearly(published: Harness,
                                                    given: str | None) -> None:
    env = {k: v for k, v in published.env().items() if k != "ANCE_REDIS_PASSWORD"}
    if given:
        env["ANCE_REDIS_PASSWORD"] = given
    started = time.monotonic()
    result = serve("inferencer", env, published.config_path, published.root / "work-refused")
    assert result.returncode == 1, result.stderr
    assert time.monotonic() - started < 45  # no 20 reconnect attempts with backoff
    output = result.stdout + result.stderr
    assert "Redis refused authentication" in output and "ANCE_REDIS_PASSWORD" in output
    assert "Traceback" not in output
    if given:
        assert given not in output
    assert S3_SECRET not in output


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:pw-1@redis:6379/0", "redis://***@redis:6379/0"),
    ("redis://user:pw-1@10.0.0.1:6379/0", "redis://***@10.0.0.1:6379/0"),
    ("see https://tok@minio:9000/b and rediss://:x@r/1", "see https://***@minio:9000/b and "
                                                        "rediss://***@r/1"),
    ("redis://redis:6379/0", "redis://redis:6379/0"),
    ("http://minio:9000/bucket/a@b", "http://minio:9000/bucket/a@b"),  # '@' in the path only
])
def test_urls_with_userinfo_are_redacted(url: str, shown: str) -> None:
    assert redact_url(url) == shown
