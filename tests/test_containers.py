"""The chart's pods as real containers, the part fast enough for the suite: the Redis image
built with podman from the Debian base (scripts/build_image.sh), and the chart's own Redis
StatefulSet played as a pod by scripts/containers/play_chart.py and answering with the
rendered password and settings. The whole run (the CPU image, every pod, a run to completion,
scaling and kills) is bench/containers.py, too slow for the suite: docs/deployment.md,
"Run on real containers", records its output.

The logic tests at the end (how a pod spec is prepared for podman) need no engine. Nothing is
faked: podman is required, and its absence fails loudly (scripts/test.sh installs it).
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import redis

REPO = Path(__file__).resolve().parents[1]
LOCAL_VALUES = REPO / "helm" / "examples" / "values-local.yaml"


def load_player() -> ModuleType:
    """scripts/containers/play_chart.py, loaded from its path (it is a script, not a package
    module; nothing is added to sys.path)."""
    spec = importlib.util.spec_from_file_location(
        "play_chart", REPO / "scripts" / "containers" / "play_chart.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


play_chart = load_player()


def local_cluster(release: str, subnet: str):
    objects, _ = play_chart.render([LOCAL_VALUES], {}, release, "default")
    return play_chart.LocalCluster(release, "default", objects, ipaddress.ip_network(subnet))


def test_podman_and_its_tools_are_installed() -> None:
    missing = [tool for tool in ("podman", "mmdebstrap") if shutil.which(tool) is None]
    assert not missing, (f"{missing} not found: scripts/test.sh installs them "
                         "(apt-get install podman buildah runc mmdebstrap)")


@pytest.mark.e2e
def test_the_charts_redis_pod_runs_from_the_built_image() -> None:
    built = subprocess.run(["bash", str(REPO / "scripts" / "build_image.sh"), "redis"],
                           capture_output=True, text=True, timeout=900, check=False)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
    # Its own release name and network, so a bench/containers.py run beside it is untouched.
    release = f"ance-train-ci{os.getpid()}"
    cluster = local_cluster(release, f"10.214.{os.getpid() % 200 + 20}.0/24")
    workload = cluster.workload("redis")
    assert workload.kind == "StatefulSet"
    pod = workload.pod_name(0)
    password = cluster.secret_values()[f"{release}-credentials"]["redis-password"]
    try:
        cluster.ensure_network()
        cluster.play(workload, pod)
        client = redis.Redis(host=cluster.address(pod), port=6379, password=password,
                             socket_timeout=2, decode_responses=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "the Redis pod never answered"
                time.sleep(0.5)
        # The chart's command line reached redis-server, $(REDIS_PASSWORD) expanded.
        assert client.config_get("appendfsync") == {"appendfsync": "always"}
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("dir") == {"dir": "/data"}
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=cluster.address(pod), port=6379, password="wrong",
                        socket_timeout=2).ping()
        # As the chart's security context asks: uid 999, read-only root file system.
        container = play_chart.main_container(pod)
        user = play_chart.engine("exec", container, "id", "-u").stdout.strip()
        assert user == "999"
        denied = play_chart.engine("exec", container, "touch", "/etc/x", check=False)
        assert denied.returncode != 0 and "Read-only file system" in denied.stderr
        # Its volume claim became a podman volume that outlives the pod; its emptyDir is
        # the pod's own volume, and a replacement pod's starts empty.
        client.set("survives", "yes")
        client.bgrewriteaof()
        play_chart.engine("exec", container, "touch", "/tmp/left-by-the-first-pod")
        assert play_chart.engine("volume", "exists", f"{pod}-tmp",
                                 check=False).returncode == 0
        cluster.remove(pod)
        cluster.play(workload, pod)
        left = play_chart.engine("exec", play_chart.main_container(pod), "ls",
                                 "/tmp/left-by-the-first-pod", check=False)
        assert left.returncode != 0, "the replacement pod's emptyDir kept the old files"
        deadline = time.monotonic() + 60
        while True:
            try:
                assert client.get("survives") == "yes"
                break
            except (redis.ConnectionError, redis.BusyLoadingError):
                assert time.monotonic() < deadline, "the replaced Redis pod never answered"
                time.sleep(0.5)
    finally:
        play_chart.command_down(cluster)


def test_a_pod_spec_is_prepared_as_a_kubelet_would() -> None:
    """What play_chart does for podman (logic only): the environment resolved, $(VAR)
    expanded, ports dropped, Service names mapped to pod addresses, a Job's pod never
    restarted in place, the claim templates turned into claims."""
    cluster = local_cluster("ance-train", "10.213.0.0/24")
    trainer = cluster.workload("trainer")
    docs = cluster.pod_manifests(trainer, trainer.pod_name(0))
    pod = next(d for d in docs if d["kind"] == "Pod")
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    assert all("valueFrom" not in e for e in env.values())
    ip = cluster.address(trainer.pod_name(0))
    assert env["POD_IP"]["value"] == ip
    assert env["ANCE_ADVERTISE_ADDRESS"]["value"] == f"{ip}:50051"
    assert env["ANCE_INSTANCE"]["value"] == "ance-train-trainer-0"
    assert env["ANCE_S3_ACCESS_KEY"]["value"] == "local-access-key"
    assert "ANCE_ANCERUN" not in env  # values-local.yaml: anceRun.enabled false
    assert all("ports" not in c for c in spec["containers"] + spec.get("initContainers", []))
    # Each emptyDir is the pod's own volume (podman 4.3 would share one named `work`).
    mounts = {m["mountPath"]: m["name"] for c in spec["containers"] for m in c["volumeMounts"]}
    assert mounts["/work"] == "ance-train-trainer-0-work"
    assert mounts["/tmp"] == "ance-train-trainer-0-tmp"
    assert {v["name"] for v in spec["volumes"] if "emptyDir" in v} == {
        "ance-train-trainer-0-work", "ance-train-trainer-0-tmp"}
    inferencer = cluster.workload("inferencer")
    other = next(d for d in cluster.pod_manifests(inferencer, inferencer.pod_name(1))
                 if d["kind"] == "Pod")
    assert {m["name"] for c in other["spec"]["containers"] for m in c["volumeMounts"]
            if m["mountPath"] == "/work"} == {"ance-train-inferencer-1-work"}
    assert all(len(str(v)) <= 63 for v in pod["metadata"]["annotations"].values())
    aliases = {name: alias["ip"] for alias in spec["hostAliases"] for name in alias["hostnames"]}
    redis_pod = cluster.workload("redis").pod_name(0)
    assert aliases["ance-train-redis"] == cluster.address(redis_pod)
    assert aliases["ance-train-indexer.default.svc.cluster.local"] == cluster.address(
        cluster.workload("indexer").pod_name(0))
    assert {d["kind"] for d in docs} >= {"ConfigMap", "Pod"}
    redis_docs = cluster.pod_manifests(cluster.workload("redis"), redis_pod)
    claim = next(d for d in redis_docs if d["kind"] == "PersistentVolumeClaim")
    redis_spec = next(d for d in redis_docs if d["kind"] == "Pod")["spec"]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}} \
        in redis_spec["volumes"]
    args = redis_spec["containers"][0]["args"]
    assert "$(REDIS_PASSWORD)" not in args and "local-redis-password" in args
    # A probe's named port became its number before the ports were dropped.
    assert redis_spec["containers"][0]["livenessProbe"]["tcpSocket"]["port"] == 6379
    addresses = {cluster.address(w.pod_name(i)) for w in cluster.workloads()
                 for i in range(w.replicas + 2)}
    assert len(addresses) == sum(w.replicas + 2 for w in cluster.workloads())
