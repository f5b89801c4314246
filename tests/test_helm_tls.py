"""The chart with encrypted and authenticated traffic (tls.grpc, tls.redis, auth.redisUsername):
every ance container gets the Secrets mounted and the ANCE_* variables that
ance_train.infra.tls reads, probes that speak TLS, and the release's Redis is TLS-only with the
run's ACL user of least privilege: the rule ance_train.infra.tls.redis_acl_rule defines
(tests/test_tls.py runs the services' Redis calls as a user with that rule). Rendered and
linted by real Helm, validated against the Kubernetes schemas (as tests/test_helm_chart.py)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import redis
from test_helm_chart import _validate_all

from ance_train.infra import bus as bus_module
from ance_train.infra.bus import EventBus
from ance_train.infra.tls import GrpcTls, redis_acl_rule
from ance_train.launcher.ports import free_port
from ance_train.protocol.events import RunFinished

from ance_train_dev.helm_render import (
    KUBE_VERSION,
    HelmError,
    containers,
    find,
    lint_chart,
    merge_values,
    one,
    pod_spec,
    render_chart,
    render_manifests,
)
from ance_train_dev.servers import REDIS_TLS_DIR, redis_tls_server
from ance_train_dev.tls_certs import make_pki

FULLNAME = "ance-train"
WORKLOADS = {"trainer": "Job", "inferencer": "Deployment", "indexer": "Deployment"}
SECURE = {
    "run": {"id": "secure-run"},
    "auth": {"redisUsername": "ance"},
    "tls": {"grpc": {"enabled": True, "secretName": "ance-grpc-tls", "mutual": True},
            "redis": {"enabled": True, "secretName": "ance-redis-tls",
                      "clientSecretName": "ance-redis-client-tls"}},
}


@pytest.fixture(scope="module")
def secure_objects() -> list[dict[str, Any]]:
    return render_chart(SECURE)


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def _secret_of(workload: dict[str, Any], container: dict[str, Any], path: str) -> str:
    """The Secret whose read-only mount holds ``path`` in ``container``."""
    volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
    for mount in container["volumeMounts"]:
        if PurePosixPath(path).parent == PurePosixPath(mount["mountPath"]):
            assert mount.get("readOnly") is True
            return volumes[mount["name"]]["secret"]["secretName"]
    raise AssertionError(f"{path} is on no mount of {container['name']}")


def test_secure_values_lint_and_validate(secure_objects: list[dict[str, Any]]) -> None:
    assert lint_chart(SECURE).ok
    for obj in secure_objects:
        if obj["kind"] in {"Job", "Deployment", "StatefulSet", "Service", "Secret", "ConfigMap"}:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_every_ance_container_gets_the_secrets_and_the_tls_settings(
        secure_objects: list[dict[str, Any]]) -> None:
    for role, kind in WORKLOADS.items():
        workload = one(secure_objects, kind, f"{FULLNAME}-{role}")
        for container in containers(workload):
            env = _env(container)
            assert env["ANCE_REDIS_URL"] == f"rediss://{FULLNAME}-redis:6379/0"
            assert env["ANCE_REDIS_USERNAME"] == "ance"
            assert env["ANCE_GRPC_TLS"] == "1" and env["ANCE_GRPC_TLS_MUTUAL"] == "1"
            assert env["ANCE_GRPC_TLS_SERVER_NAME"] == f"{FULLNAME}-grpc"
            expected = {"ANCE_GRPC_TLS_CA": ("ance-grpc-tls", "ca.crt"),
                        "ANCE_GRPC_TLS_CERT": ("ance-grpc-tls", "tls.crt"),
                        "ANCE_GRPC_TLS_KEY": ("ance-grpc-tls", "tls.key"),
                        "ANCE_REDIS_TLS_CA": ("ance-redis-tls", "ca.crt"),
                        "ANCE_REDIS_TLS_CERT": ("ance-redis-client-tls", "tls.crt"),
                        "ANCE_REDIS_TLS_KEY": ("ance-redis-client-tls", "tls.key")}
            for var, (secret, key) in expected.items():
                assert PurePosixPath(env[var]).name == key, (role, var)
                assert _secret_of(workload, container, env[var]) == secret, (role, var)
        main = pod_spec(workload)["containers"][-1]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "grpc" not in main[probe], (role, probe)  # native probes cannot speak TLS
            assert main[probe]["exec"]["command"] == [
                "python", "-m", "ance_train.infra.health_probe", "50051"], (role, probe)


@pytest.mark.parametrize("variant", [
    {"trainer": {"kubeflow": {"enabled": True}, "nodes": 2}},
    {"trainer": {"nodes": 2, "procsPerNode": 2, "gpus": 2}},
    {"run": {"config": {"index": {"partitions": 3}}}},
], ids=["kubeflow", "trainer-ranks", "index-partitions"])
def test_every_workload_shape_gets_the_tls_secrets(variant: dict[str, Any]) -> None:
    objects = render_chart(merge_values(SECURE, variant))
    _validate_all(objects)
    pods = [pod_spec(o) for o in objects if o["kind"] in {"Job", "Deployment", "StatefulSet"}]
    pods += [replica["template"]["spec"] for o in find(objects, "PyTorchJob")
             for replica in o["spec"]["pytorchReplicaSpecs"].values()]
    ance = [c for spec in pods for c in [*spec.get("initContainers", []), *spec["containers"]]
            if "ANCE_CONFIG" in _env(c)]
    assert len(ance) >= 4
    for container in ance:
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/etc/ance-tls/grpc", "/etc/ance-tls/redis"} <= mounts, container["name"]
        assert _env(container)["ANCE_GRPC_TLS"] == "1"


def _config_lines(args: list[str]) -> dict[str, list[list[str]]]:
    """redis-server's command line as its config lines: ``--name v1 v2`` → name: [v1, v2]."""
    lines: dict[str, list[list[str]]] = {}
    for arg in args:
        if arg.startswith("--"):
            lines.setdefault(arg[2:], []).append([])
        else:
            next(reversed(lines.values()))[-1].append(arg)
    return lines


def test_release_redis_is_tls_only_with_the_runs_acl_user(
        secure_objects: list[dict[str, Any]]) -> None:
    redis = one(secure_objects, "StatefulSet", f"{FULLNAME}-redis")
    container = pod_spec(redis)["containers"][0]
    config = _config_lines(container["args"])
    users = {line[0]: line[1:] for line in config["user"]}
    assert users["default"] == ["off"]  # the all-powerful default user cannot log in
    assert users["ance"] == ["on", ">$(REDIS_PASSWORD)", *redis_acl_rule("secure-run")]
    assert "requirepass" not in config
    assert config["port"] == [["0"]] and config["tls-port"] == [["6379"]]
    assert config["tls-auth-clients"] == [["yes"]]
    for option, key in (("tls-cert-file", "tls.crt"), ("tls-key-file", "tls.key"),
                        ("tls-ca-cert-file", "ca.crt")):
        path = config[option][0][0]
        assert PurePosixPath(path).name == key
        assert _secret_of(redis, container, path) == "ance-redis-tls"
    probe = container["readinessProbe"]["exec"]["command"][-1]
    assert "--user ance --tls --cacert /etc/ance-tls/redis/ca.crt" in probe
    assert _secret_of(redis, container, "/etc/ance-tls/redis-client/tls.crt") == (
        "ance-redis-client-tls")


def test_defaults_stay_plaintext(tmp_path) -> None:
    objects = render_chart()
    for role, kind in WORKLOADS.items():
        workload = one(objects, kind, f"{FULLNAME}-{role}")
        for container in containers(workload):
            env = _env(container)
            assert env["ANCE_REDIS_URL"].startswith("redis://")
            assert not {n for n in env if "TLS" in n or n == "ANCE_REDIS_USERNAME"}
            assert GrpcTls.from_env(env) is None
    redis = pod_spec(one(objects, "StatefulSet", f"{FULLNAME}-redis"))["containers"][0]
    assert "--requirepass" in redis["args"] and "--tls-port" not in redis["args"]
    assert not find(objects, "Secret", "ance-grpc-tls")


@pytest.mark.parametrize(("values", "field"), [
    ({"tls": {"grpc": {"enabled": True}}}, "secretName"),
    ({"tls": {"redis": {"enabled": True, "secretName": ""}}}, "secretName"),
    ({"tls": {"grpc": {"enabled": True, "secretName": "s", "mutal": True}}}, "mutal"),
    ({"auth": {"redisUsername": "no spaces"}}, "redisUsername"),
])
def test_values_schema_rejects_bad_tls_values(values: dict[str, Any], field: str) -> None:
    with pytest.raises(HelmError, match=field):
        render_manifests(values)


def test_release_redis_command_line_runs_a_real_redis_the_services_can_use(
        secure_objects: list[dict[str, Any]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The rendered Redis container (arguments, readiness probe) and the services' rendered
    environment, with the Secrets' mount point pointed at certificates made here and the
    password filled in as Kubernetes would: a TLS-built redis-server starts with them, the
    probe's redis-cli gets PONG, and the services' own client works as the ACL user."""
    tls_dir = tmp_path / "tls"
    make_pki(tls_dir / "redis")  # ca.crt, tls.crt, tls.key: a kubernetes.io/tls Secret
    (tls_dir / "redis-client").mkdir()
    shutil.copy(tls_dir / "redis" / "client.crt", tls_dir / "redis-client" / "tls.crt")
    shutil.copy(tls_dir / "redis" / "client.key", tls_dir / "redis-client" / "tls.key")
    password, port = "chart-redis-password", free_port()

    def local(text: str) -> str:
        return (text.replace("/etc/ance-tls", str(tls_dir)).replace("$(REDIS_PASSWORD)", password)
                .replace("6379", str(port)))

    container = pod_spec(one(secure_objects, "StatefulSet", f"{FULLNAME}-redis"))["containers"][0]
    args = [local(arg) for arg in container["args"]]
    args[args.index("--dir") + 1] = str(tmp_path)
    binary, env = redis_tls_server()
    server = subprocess.Popen([binary, *args, "--bind", "127.0.0.1"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        probe = local(container["readinessProbe"]["exec"]["command"][-1]).replace(
            "redis-cli", str(REDIS_TLS_DIR / "usr" / "bin" / "redis-cli"), 1)
        deadline = time.monotonic() + 10
        while (answer := subprocess.run(["sh", "-c", probe], capture_output=True, text=True,
                                        env={**env, "REDISCLI_AUTH": password})).returncode:
            assert server.poll() is None and time.monotonic() < deadline, (probe, answer)
            time.sleep(0.1)
        ance = _env(containers(one(secure_objects, "Deployment", f"{FULLNAME}-indexer"))[0])
        for name, value in ance.items():
            if name.startswith(("ANCE_REDIS_TLS_", "ANCE_REDIS_USERNAME")):
                monkeypatch.setenv(name, local(value))
        monkeypatch.setenv("ANCE_REDIS_PASSWORD", password)
        url = local(ance["ANCE_REDIS_URL"]).replace(f"{FULLNAME}-redis", "127.0.0.1")
        bus = EventBus(bus_module.connect(url), "secure-run")
        bus.publish(RunFinished(step=4))
        assert [r.event.step for r in bus.consume(RunFinished, "g", "c", block_ms=100)] == [4]
        with pytest.raises(redis.exceptions.NoPermissionError):
            bus.client.flushall()
        other_run = EventBus(bus.client, "another-run")
        with pytest.raises(redis.exceptions.NoPermissionError):
            other_run.publish(RunFinished(step=1))
        monkeypatch.setenv("ANCE_REDIS_USERNAME", "default")  # switched off
        with pytest.raises(bus_module.RedisAuthError):
            bus_module.connect(url).ping()
    finally:
        server.terminate()
        server.wait(10)
