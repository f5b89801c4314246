"""What an operator needs from the chart beyond the workloads (issue 28): credentials an
external store knows, NOTES that match the objects, GPU scheduling, a default install without
a volume to create first, PodDisruptionBudgets and a `helm test` hook. Rendered and linted by
real Helm (helm_render), objects validated as in tests/test_helm_chart.py; the scripts the
chart runs in its pods (waiting for the dataset, the helm test's health checks) are run here
against real servers: a moto S3 server, gRPC health servers, the Kubernetes API stand-in."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from minio import Minio
from test_helm_chart import _validate_all, selects

from ance_train.infra.rpc import GrpcServer, ServiceState

from ance_train_dev.helm_render import (
    REPO_ROOT,
    HelmError,
    containers,
    find,
    lint_chart,
    one,
    pod_spec,
    render_chart,
    render_manifests,
    render_notes,
)
from ance_train_dev.kube_standin import KubeStandIn, role_allows

FULLNAME = "ance-train"
EXAMPLES = REPO_ROOT / "helm" / "examples"
BILLION = EXAMPLES / "values-billion.yaml"
GPU = EXAMPLES / "values-gpu.yaml"
ROLES = {"trainer": "Job", "inferencer": "Deployment", "indexer": "Deployment"}
EXTERNAL_S3 = {"minio": {"enabled": False},
               "externalS3": {"endpoint": "s3.storage.example.internal:443"}}
EXTERNAL_REDIS = {"redis": {"enabled": False},
                  "externalRedis": {"host": "redis.data.svc.cluster.local"}}
PARTITIONS = {"run": {"config": {"index": {"partitions": 3}}}}


def _render_error(values: dict[str, Any] | None = None, values_files: tuple = ()) -> str:
    with pytest.raises(HelmError) as failure:
        render_manifests(values, values_files)
    return str(failure.value)


# --------------------------------------------------------------------------- 1. credentials


@pytest.mark.parametrize(
    ("values", "named"),
    [
        (EXTERNAL_S3, ["externalS3.endpoint s3.storage.example.internal:443",
                       "auth.s3AccessKey, auth.s3SecretKey"]),
        (EXTERNAL_REDIS, ["externalRedis.host redis.data.svc.cluster.local",
                          "or set auth.redisPassword"]),
        ({**EXTERNAL_S3, "auth": {"s3AccessKey": "AKIAEXAMPLE7Q"}}, ["or set auth.s3SecretKey"]),
    ],
    ids=["external-store", "external-redis", "half-the-keys"],
)
def test_external_endpoints_without_credentials_fail_the_render(
    values: dict[str, Any], named: list[str],
) -> None:
    """Generated keys suit only the release's own MinIO / Redis (they take theirs from the
    Secret): an external one knows other keys, so the render fails saying what to set."""
    message = _render_error(values)
    assert "no credentials for" in message, message
    assert "auth.existingSecret" in message, message
    assert "s3-access-key, s3-secret-key" in message, message  # the keys it must hold
    for text in named:
        assert text in message, (text, message)


@pytest.mark.parametrize(
    "auth",
    [{"existingSecret": "store-credentials"},
     {"s3AccessKey": "AKIAEXAMPLE7Q", "s3SecretKey": "s3-Secret-abcdefghij0123456789"}],
    ids=["existing-secret", "given-keys"],
)
def test_external_store_with_credentials_renders(auth: dict[str, str]) -> None:
    objects = render_chart({**EXTERNAL_S3, "auth": auth})
    _validate_all(objects)
    secrets = find(objects, "Secret")
    if "existingSecret" in auth:
        assert not secrets
    else:
        (secret,) = secrets  # the keys given; the release's Redis password generated
        assert set(secret["data"]) == {"redis-password", "s3-access-key", "s3-secret-key"}
    env = {e["name"]: e for e in containers(one(objects, "Deployment",
                                                f"{FULLNAME}-inferencer"))[0]["env"]}
    assert env["ANCE_S3_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == (
        auth.get("existingSecret") or f"{FULLNAME}-credentials")


def test_billion_values_name_a_secret_and_fail_without_it() -> None:
    """values-billion.yaml uses an external store: it names the Secret of its keys (so it
    renders: test_billion_document_values_render_the_planned_shape), and without that
    reference the render fails with the message."""
    values = yaml.safe_load(BILLION.read_text())
    assert values["minio"]["enabled"] is False
    assert values["auth"]["existingSecret"] == "ance-web-1b-credentials"
    render_manifests(values_files=[BILLION])
    message = _render_error({"auth": {"existingSecret": ""}}, (BILLION,))
    assert "auth.existingSecret" in message and "externalS3.endpoint" in message, message
    # The instruction to create it, in the file itself.
    assert "kubectl -n ml create secret generic ance-web-1b-credentials" in BILLION.read_text()


# --------------------------------------------------------------------------- 2. NOTES


def _kubectl_targets(notes: str) -> list[tuple[str, str]]:
    """(kind, name) of every `kubectl ... <kind>/<name>` and bare pod name in the NOTES."""
    kinds = {"deploy": "Deployment", "statefulset": "StatefulSet", "job": "Job",
             "svc": "Service", "scaledobject": "ScaledObject"}
    found = [(kinds[k], name) for k, name in re.findall(
        r"\b(deploy|statefulset|job|svc)/([a-z0-9-]+)", notes)]
    found += [("Pod", name) for name in re.findall(
        r"kubectl -n \S+ (?:logs -f|exec) ([a-z0-9-]+-\d+)\b", notes)]
    return found


@pytest.mark.parametrize("values", [{}, PARTITIONS], ids=["one-indexer", "partitions"])
def test_notes_name_only_objects_the_release_has(values: dict[str, Any]) -> None:
    """Every object the NOTES tell kubectl to act on exists in that render: with index
    partitions the indexer is a StatefulSet (no deploy/…-indexer), its pods <name>-indexer-<i>."""
    objects = render_chart(values)
    notes = render_notes(values)
    targets = _kubectl_targets(notes)
    assert targets
    for kind, name in targets:
        if kind == "Pod":  # a StatefulSet's pod: <statefulset>-<ordinal>
            base, ordinal = name.rsplit("-", 1)
            (sts,) = find(objects, "StatefulSet", base)
            assert int(ordinal) < sts["spec"]["replicas"], name
        else:
            one(objects, kind, name)


def test_notes_for_a_partitioned_indexer() -> None:
    notes = render_notes(PARTITIONS)
    assert f"deploy/{FULLNAME}-indexer" not in notes
    assert f"logs -f statefulset/{FULLNAME}-indexer" in notes
    assert f"logs -f {FULLNAME}-indexer-0" in notes  # partition 0 merges and mines
    assert "component=indexer --prefix --max-log-requests 3" in notes  # every partition
    assert f"exec {FULLNAME}-indexer-0 -- ance-train status" in notes
    assert f"indexer ×3 (index partitions: StatefulSet {FULLNAME}-indexer" in notes
    single = render_notes()
    assert f"logs -f deploy/{FULLNAME}-indexer" in single and "statefulset/" not in single
    assert f"exec deploy/{FULLNAME}-indexer -- ance-train status" in single


# --------------------------------------------------------------------------- 3. GPUs, scheduling

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def test_gpu_values_put_each_role_on_gpu_nodes() -> None:
    assert lint_chart(values_files=[GPU]).ok
    objects = render_chart(values_files=[GPU])
    _validate_all(objects)
    for role, kind in ROLES.items():
        spec = pod_spec(one(objects, kind, f"{FULLNAME}-{role}"))
        main = spec["containers"][0]
        assert main["resources"]["requests"]["nvidia.com/gpu"] == 1, role
        assert main["resources"]["limits"]["nvidia.com/gpu"] == 1, role
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}, role
        assert spec["tolerations"] == [GPU_TOLERATION], role
        for init in spec.get("initContainers", []):  # GPUs for the main container only
            assert "nvidia.com/gpu" not in init["resources"].get("limits", {}), init["name"]
    anti = pod_spec(one(objects, "Deployment", f"{FULLNAME}-inferencer"))["affinity"]
    assert anti["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    for component in ("redis", "minio"):  # no GPU, kept off the GPU nodes
        spec = pod_spec(one(objects, "StatefulSet", f"{FULLNAME}-{component}"))
        assert not {"nodeSelector", "tolerations", "affinity"} & set(spec), component


def test_scheduling_defaults_apply_to_every_pod_unless_a_role_sets_its_own() -> None:
    pool = {"nodeSelector": {"pool": "ml"},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml",
                             "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "preference": {"matchExpressions": [
                    {"key": "zone", "operator": "In", "values": ["a"]}]}}]}}}
    own = {"nodeSelector": {"gpu-pool": "inference"}, "tolerations": [GPU_TOLERATION]}
    objects = render_chart({**pool, "inferencer": own, "redis": {"affinity": {}}})
    _validate_all(objects)
    pods = {o["metadata"]["name"]: pod_spec(o) for kind in ("Job", "Deployment", "StatefulSet")
            for o in find(objects, kind)}
    pods[f"{FULLNAME}-test-grpc-health"] = one(objects, "Pod",
                                               f"{FULLNAME}-test-grpc-health")["spec"]
    assert len(pods) == 6
    for name, spec in pods.items():
        expected = {**pool, **own} if name == f"{FULLNAME}-inferencer" else pool
        for field in ("nodeSelector", "tolerations", "affinity"):
            assert spec[field] == expected[field], (name, field)
    assert not {"nodeSelector", "tolerations", "affinity"} & set(
        pod_spec(one(render_chart(), "Deployment", f"{FULLNAME}-indexer")))


# --------------------------------------------------------------------------- 4. the dataset


def _wait_command(objects: list[dict[str, Any]]) -> list[str]:
    job = one(objects, "Job", f"{FULLNAME}-trainer")
    (wait,) = [c for c in pod_spec(job)["initContainers"] if c["name"] == "wait-for-data"]
    return wait["command"]


def test_the_trainer_waits_for_the_dataset_only_in_a_bucket() -> None:
    objects = render_chart()
    job = one(objects, "Job", f"{FULLNAME}-trainer")
    inits = pod_spec(job)["initContainers"]
    assert [c["name"] for c in inits] == ["wait-for-data", "prepare"]
    command = _wait_command(objects)
    assert command[:2] == ["python", "-c"] and command[3:] == ["3600", "15"]
    # The same environment (S3 settings, ANCE_CONFIG) and mounts as prepare.
    hub_only = {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME"}  # prepare's own
    assert inits[0]["env"] == [e for e in inits[1]["env"] if e["name"] not in hub_only]
    assert inits[0]["volumeMounts"] == inits[1]["volumeMounts"]
    assert _wait_command(render_chart({"data": {"waitSeconds": 60}}))[3] == "60"
    for values in ({"data": {"waitSeconds": 0}},
                   {"data": {"existingClaim": "ance-data"},
                    "run": {"config": {"data": {"path": "/data/scifact"}}}}):
        job = one(render_chart(values), "Job", f"{FULLNAME}-trainer")
        assert [c["name"] for c in pod_spec(job)["initContainers"]] == ["prepare"], values


def _upload(env: dict[str, str], bucket: str, files: dict[str, str]) -> None:
    client = Minio(env["ANCE_S3_ENDPOINT"], access_key=env["ANCE_S3_ACCESS_KEY"],
                   secret_key=env["ANCE_S3_SECRET_KEY"], secure=False)
    if not client.bucket_exists(bucket):
        client.make_bucket(bucket)
    for key, text in files.items():
        data = text.encode()
        client.put_object(bucket, key, io.BytesIO(data), len(data))


def test_wait_for_data_runs_until_the_upload_is_there(
    s3_env: dict[str, str], tmp_path: Path,
) -> None:
    """The rendered wait-for-data command, run with the run's S3 settings against a real S3
    server: it gives up (exit 1, naming what is missing) while the dataset is not in its
    bucket, and exits 0 once the files `ance-train prepare` reads are there."""
    bucket, prefix = "wait-data", "beir/tiny/"
    values = {"run": {"config": {"data": {"path": f"s3://{bucket}/{prefix}"}}}}
    objects = render_chart(values)
    config = tmp_path / "config.yaml"
    config.write_text(one(objects, "ConfigMap", f"{FULLNAME}-config")["data"]["config.yaml"])
    command = _wait_command(objects)
    argv = [sys.executable, *command[1:3], "1", "0.2"]  # wait 1 s, poll every 0.2 s
    env = {**s3_env, "ANCE_CONFIG": str(config), "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path), "ANCE_S3_RETRY_SECONDS": "1"}

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)

    missing_bucket = run()
    assert missing_bucket.returncode == 1, missing_bucket.stderr
    assert "gave up after 1 s waiting for the dataset" in missing_bucket.stderr
    assert "waiting for the dataset in s3://wait-data/beir/tiny/" in missing_bucket.stdout
    _upload(s3_env, bucket, {prefix + "corpus.jsonl": '{"_id": "d1", "text": "x"}\n'})
    partial = run()
    assert partial.returncode == 1 and "queries" in partial.stderr, partial.stderr
    _upload(s3_env, bucket, {prefix + "queries.jsonl": '{"_id": "q1", "text": "y"}\n',
                             prefix + "qrels/train.tsv": "query-id\tcorpus-id\tscore\n"})
    complete = run()
    assert complete.returncode == 0, complete.stderr
    assert f"the dataset is in s3://{bucket}/{prefix}" in complete.stdout


# --------------------------------------------------------------------------- 5. disruption budgets


def test_disruption_budgets_protect_indexer_redis_and_minio() -> None:
    objects = render_chart()
    _validate_all(objects)
    budgets = {o["metadata"]["name"]: o["spec"] for o in find(objects, "PodDisruptionBudget")}
    assert set(budgets) == {f"{FULLNAME}-{c}" for c in ("indexer", "redis", "minio")}
    workloads = [o for kind in ("Job", "Deployment", "StatefulSet") for o in find(objects, kind)]
    for name, spec in budgets.items():
        assert spec["maxUnavailable"] == 0 and spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
        selected = [w["metadata"]["name"] for w in workloads
                    if selects(spec["selector"], w["spec"]["template"]["metadata"]["labels"])]
        assert selected == [name], (name, selected)  # its own pods and no others
    # Every partition of a partitioned indexer.
    partitioned = render_chart(PARTITIONS)
    spec = one(partitioned, "PodDisruptionBudget", f"{FULLNAME}-indexer")["spec"]
    sts = one(partitioned, "StatefulSet", f"{FULLNAME}-indexer")
    assert selects(spec["selector"], sts["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize(
    ("values", "left"),
    [
        ({"indexer": {"podDisruptionBudget": {"enabled": False, "maxUnavailable": 0}}},
         {"redis", "minio"}),
        ({"redis": {"podDisruptionBudget": {"enabled": False, "maxUnavailable": 0}},
          "minio": {"podDisruptionBudget": {"enabled": False, "maxUnavailable": 0}}},
         {"indexer"}),
        ({**EXTERNAL_REDIS, **EXTERNAL_S3, "auth": {"existingSecret": "ext"}}, {"indexer"}),
    ],
    ids=["indexer-off", "stores-off", "external-stores"],
)
def test_disruption_budgets_can_be_turned_off(values: dict[str, Any], left: set[str]) -> None:
    budgets = find(render_chart(values), "PodDisruptionBudget")
    assert {b["metadata"]["name"] for b in budgets} == {f"{FULLNAME}-{c}" for c in left}


def test_disruption_budget_allows_a_percentage_and_rejects_nonsense() -> None:
    spec = one(render_chart({"indexer": {"podDisruptionBudget": {
        "enabled": True, "maxUnavailable": "25%"}}}), "PodDisruptionBudget",
        f"{FULLNAME}-indexer")["spec"]
    assert spec["maxUnavailable"] == "25%"
    message = _render_error({"redis": {"podDisruptionBudget": {"enabled": True,
                                                               "maxUnavailable": -1}}})
    assert "/redis/podDisruptionBudget/maxUnavailable" in message, message


# --------------------------------------------------------------------------- 6. helm test


def _hook(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "Pod", f"{FULLNAME}-test-grpc-health")


def test_helm_test_hook_checks_every_service() -> None:
    objects = render_chart()
    pod = _hook(objects)
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    (main,) = spec["containers"]
    command = main["command"]
    assert command[:2] == ["python", "-c"] and command[3] == "120"
    targets = dict(arg.split("=", 1) for arg in command[4:])
    assert set(targets) == set(ROLES)
    for role, address in targets.items():  # each role's Service, on its gRPC port
        host, port = address.rsplit(":", 1)
        service = one(objects, "Service", host)
        assert {p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"} == {
            int(port)}
        assert service["spec"]["selector"]["app.kubernetes.io/component"] == role
    # Its ServiceAccount may read the release's AnceRun (the finished-trainer case).
    assert spec["serviceAccountName"] == FULLNAME
    # The services' NetworkPolicy covers it: egress to the ance pods' gRPC port.
    policy = one(objects, "NetworkPolicy", f"{FULLNAME}-services")["spec"]
    assert selects(policy["podSelector"], pod["metadata"]["labels"])
    assert not any(selects({"matchLabels": s["spec"]["selector"]}, pod["metadata"]["labels"])
                   for s in find(objects, "Service"))  # no Service sends it traffic
    _validate_all(objects)
    assert not find(render_chart({"helmTest": {"enabled": False}}), "Pod")


def test_helm_test_hook_speaks_the_services_tls() -> None:
    values = {"tls": {"grpc": {"enabled": True, "secretName": "ance-grpc-tls", "mutual": True}}}
    objects = render_chart(values)
    (main,) = _hook(objects)["spec"]["containers"]
    inferencer = containers(one(objects, "Deployment", f"{FULLNAME}-inferencer"))[0]
    tls_env = [e for e in inferencer["env"] if e["name"].startswith("ANCE_GRPC_TLS")]
    assert len(tls_env) == 6 and all(e in main["env"] for e in tls_env)
    mounts = [m for m in inferencer["volumeMounts"] if m["name"] == "tls-grpc"]
    assert mounts and all(m in main["volumeMounts"] for m in mounts)
    (volume,) = [v for v in _hook(objects)["spec"]["volumes"] if v["name"] == "tls-grpc"]
    assert volume["secret"]["secretName"] == "ance-grpc-tls"
    _validate_all(objects)


@pytest.fixture
def health_servers() -> Any:
    servers = {role: GrpcServer(ServiceState(role, "ance-run", f"{role}-0")).start()
               for role in ROLES}
    try:
        yield servers
    finally:
        for server in servers.values():
            server.stop(grace_s=0.1)


def _run_hook(servers: dict[str, GrpcServer], env: dict[str, str] | None = None,
              timeout_s: str = "1") -> subprocess.CompletedProcess[str]:
    """The rendered hook's script, run here with its Services' addresses swapped for the
    local health servers'."""
    (main,) = _hook(render_chart())["spec"]["containers"]
    script, _, *targets = main["command"][2:]
    local = [f"{t.split('=')[0]}={servers[t.split('=')[0]].address}" for t in targets]
    return subprocess.run([sys.executable, "-c", script, timeout_s, *local],
                          env={"PATH": "/usr/bin:/bin", "ANCE_K8S_NAMESPACE": "ml",
                               "ANCE_ANCERUN": FULLNAME, **(env or {})},
                          capture_output=True, text=True, timeout=120)


def test_helm_test_script_passes_when_every_service_serves(health_servers: Any) -> None:
    answer = _run_hook(health_servers)
    assert answer.returncode == 0, answer.stderr
    for role in ROLES:
        assert f"{role} (127.0.0.1:" in answer.stdout and "SERVING" in answer.stdout


def test_helm_test_script_fails_naming_a_service_that_does_not_serve(
    health_servers: Any,
) -> None:
    health_servers["indexer"].set_serving(False)
    answer = _run_hook(health_servers)
    assert answer.returncode == 1, answer.stdout
    assert "indexer (127.0.0.1:" in answer.stdout and "NOT_SERVING" in answer.stdout
    assert "not serving: indexer" in answer.stderr


@pytest.mark.parametrize(("phase", "passes"), [("Succeeded", True), ("Training", False)])
def test_helm_test_script_accepts_a_finished_trainer(
    health_servers: Any, phase: str, passes: bool,
) -> None:
    """Once training is done the trainer's pod has exited: its check then passes only if the
    release's AnceRun says Succeeded (read through the Kubernetes API)."""
    health_servers["trainer"].stop(grace_s=0.1)
    chart = render_chart()
    with KubeStandIn(one(chart, "AnceRun", FULLNAME), "ml",
                     one(chart, "CustomResourceDefinition", "anceruns.ance-train.io")) as api:
        api.handle("PATCH", f"/apis/ance-train.io/v1alpha1/namespaces/ml/anceruns/{FULLNAME}"
                   "/status", "application/merge-patch+json", {"status": {"phase": phase}})
        assert api.status.get("phase") == phase
        asked = len(api.requests)
        answer = _run_hook(health_servers, {"ANCE_KUBE_API": api.url})
        reads = api.requests[asked:]
    assert (answer.returncode == 0) == passes, (answer.stdout, answer.stderr)
    # It read the AnceRun, which the release's Role lets its ServiceAccount do.
    assert reads and all(r.verb == "get" and r.resource == "anceruns" for r in reads), reads
    rules = one(chart, "Role", FULLNAME)["rules"]
    assert all(role_allows(rules, r) for r in reads)
    if passes:
        assert "trainer (127.0.0.1:" in answer.stdout and "the run Succeeded" in answer.stdout
    else:
        assert "not serving: trainer" in answer.stderr
