"""The Helm chart (helm/ance-train) and the container images (docker/).

Rendering and linting are done by real Helm (Helm's Go SDK through helm-python-sdk, see
helm_render.py); Kubernetes objects are validated against the Kubernetes OpenAPI schemas that
kubernetes-validate ships. No Kubernetes API server can run here, so nothing is installed:
what an install would create is checked object by object. Which kinds are validated how:

- every built-in kind (Job, Deployment, StatefulSet, Service, Secret, ConfigMap,
  ServiceAccount, Role, RoleBinding, NetworkPolicy, CustomResourceDefinition):
  kubernetes-validate, strict;
- AnceRun: the openAPIV3Schema of the chart's own CRD (jsonschema);
- PyTorchJob (trainer.kubeflow.enabled): the openAPIV3Schema of the Kubeflow training
  operator's CRD, a fixture under tests/fixtures/crds/ naming its source and release
  (jsonschema, and no field the schema lacks, which an API server would prune), and its pod
  templates as core/v1 PodTemplates (kubernetes-validate, strict);
- ScaledObject and TriggerAuthentication (inferencer.keda.enabled): the openAPIV3Schema of
  KEDA's CRDs, fixtures under tests/fixtures/crds/ naming their source and release
  (jsonschema, and no field the schema lacks), as the PyTorchJob (tests/test_helm_keda.py);
- ServiceMonitor (Prometheus Operator, no schema here): the fields it needs, asserted one by
  one in test_service_monitor_scrapes_every_ance_service.
"""

from __future__ import annotations

import base64
import functools
import io
import os
import re
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from ance_train.config import parse_config
from ance_train.indexer.partitions import PARTITION_VAR, partition_number
from ance_train.launcher.embedded import RANKS_ENV, service_command

from ance_train_dev.helm_render import (
    CHART_DIR,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    REPO_ROOT,
    HelmError,
    containers,
    find,
    lint_chart,
    one,
    pod_spec,
    render_chart,
    render_crds,
    render_manifests,
    render_notes,
)

PRODUCTION = Path(__file__).parent / "fixtures" / "helm" / "values-production.yaml"
# The training operator's PyTorchJob CRD (kubeflow.org/v1), release v1.9.0: see its header.
PYTORCHJOB_CRD = Path(__file__).parent / "fixtures" / "crds" / "kubeflow.org_pytorchjobs.yaml"
# KEDA's CRDs (keda.sh/v1alpha1), release v2.20.1: see their headers.
KEDA_CRDS = {kind: Path(__file__).parent / "fixtures" / "crds" / f"keda.sh_{plural}.yaml"
             for kind, plural in (("ScaledObject", "scaledobjects"),
                                  ("TriggerAuthentication", "triggerauthentications"))}
FULLNAME = "ance-train"  # release "ance-train" of chart "ance-train"
# The ance workloads: the trainer finishes (a Job), the others serve until uninstalled.
WORKLOAD_KINDS = {"trainer": "Job", "inferencer": "Deployment", "indexer": "Deployment"}
ROLES = tuple(WORKLOAD_KINDS)
WORKLOAD_TYPES = ("Job", "Deployment", "StatefulSet")
# As the module docstring says.
CUSTOM_KINDS = {"AnceRun", "ServiceMonitor", "PyTorchJob", *KEDA_CRDS}

# The environment contract between the chart and the services (see docs/deployment.md).
CONTRACT_ENV = {
    "ANCE_CONFIG", "ANCE_REDIS_URL", "ANCE_REDIS_PASSWORD", "ANCE_S3_ENDPOINT",
    "ANCE_S3_BUCKET", "ANCE_S3_SECURE", "ANCE_S3_ACCESS_KEY", "ANCE_S3_SECRET_KEY",
    "ANCE_WORK_DIR", "ANCE_GRPC_HOST", "ANCE_GRPC_PORT", "ANCE_INSTANCE",
    "ANCE_ADVERTISE_ADDRESS", "ANCE_METRICS_PORT", "ANCE_CLUSTER_MODE", "ANCE_K8S_NAMESPACE",
    "ANCE_ANCERUN",
}
SECRET_ENV = {"ANCE_REDIS_PASSWORD", "ANCE_S3_ACCESS_KEY", "ANCE_S3_SECRET_KEY"}


@pytest.fixture(scope="module")
def default_objects() -> list[dict[str, Any]]:
    return render_chart()


@pytest.fixture(scope="module")
def production_objects() -> list[dict[str, Any]]:
    return render_chart(values_files=[PRODUCTION])


def ance_workloads(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {role: one(objects, kind, f"{FULLNAME}-{role}")
            for role, kind in WORKLOAD_KINDS.items()}


def all_workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every object that runs pods: the ance workloads and the chart's Redis / MinIO."""
    return [o for kind in WORKLOAD_TYPES for o in find(objects, kind)]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in container.get("env", [])}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels / matchExpressions) selects labels."""
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        present, value, listed = expr["key"] in labels, labels.get(expr["key"]), expr.get(
            "values", [])
        if not {"In": value in listed, "NotIn": value not in listed, "Exists": present,
                "DoesNotExist": not present}[expr["operator"]]:
            return False
    return True


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


# --------------------------------------------------------------------------- helm lint


@pytest.mark.parametrize("values_files", [[], [PRODUCTION]], ids=["defaults", "production"])
def test_helm_lint_strict_passes(values_files: list[Path]) -> None:
    result = lint_chart(values_files=values_files)
    assert result.ok, result.errors
    # Helm did lint the chart: its informational findings are reported.
    assert any(m["path"] == "Chart.yaml" for m in result.messages)


@pytest.mark.parametrize(
    ("template", "old", "new", "expected"),
    [
        # A template function that does not exist: a parse error.
        ("inferencer.yaml", "replicas: {{ .Values.inferencer.replicas | int }}",
         "replicas: {{ .Values.inferencer.replicas | nosuchfunction }}", "nosuchfunction"),
        # Valid template syntax whose output is not valid YAML.
        ("configmap.yaml", "  config.yaml: |", "config.yaml: : |", "configmap.yaml"),
    ],
    ids=["template-error", "yaml-error"],
)
def test_broken_template_fails_lint_and_render(
    tmp_path: Path, template: str, old: str, new: str, expected: str
) -> None:
    chart = tmp_path / "ance-train"
    shutil.copytree(CHART_DIR, chart)
    path = chart / "templates" / template
    text = path.read_text()
    assert old in text, f"{template} changed: update this test's breakage"
    path.write_text(text.replace(old, new))

    result = lint_chart(chart_dir=chart)
    assert not result.ok
    assert any(expected in error for error in result.errors), result.errors
    with pytest.raises((HelmError, yaml.YAMLError)):
        render_chart(chart_dir=chart)


# --------------------------------------------------------------------------- values schema


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"inferencer": {"replicas": -1}}, "/inferencer/replicas"),
        ({"inferencer": {"replicas": "four"}}, "/inferencer/replicas"),
        ({"inferencer": {"replicas": 2, "replica": 3}}, "replica"),
        ({"replicas": 3}, "replicas"),
        ({"trainer": {"gpus": 0.5}}, "/trainer/gpus"),
        ({"run": {"id": "Not_A_Valid_Id"}}, "/run/id"),
        ({"run": {"config": {"run_id": "x"}}}, "/run/config"),
        ({"redis": {"enabled": False}}, "/externalRedis/host"),
        ({"minio": {"enabled": False}}, "/externalS3/endpoint"),
        ({"externalS3": {"endpoint": "https://s3.example.internal"}}, "/externalS3/endpoint"),
        ({"redis": {"image": {"pullPolicy": "Sometimes"}}}, "/redis/image/pullPolicy"),
        ({"trainer": {"backoffLimit": -1}}, "/trainer/backoffLimit"),
        ({"trainer": {"backoffLimit": "a few"}}, "/trainer/backoffLimit"),
        ({"trainer": {"activeDeadlineSeconds": 0}}, "/trainer/activeDeadlineSeconds"),
        ({"trainer": {"ttlSecondsAfterFinished": -1}}, "/trainer/ttlSecondsAfterFinished"),
        ({"trainer": {"replicas": 2}}, "replicas"),
    ],
)
def test_values_schema_rejects_bad_values(values: dict[str, Any], field: str) -> None:
    with pytest.raises(HelmError) as failure:
        render_manifests(values)
    message = str(failure.value)
    assert "schema" in message or "at '" in message, message
    assert field in message, message


def test_lint_reports_the_bad_field() -> None:
    result = lint_chart({"inferencer": {"replicas": -1}})
    assert not result.ok
    assert any("/inferencer/replicas" in error for error in result.errors), result.errors


# --------------------------------------------------------------------------- schemas


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"networkPolicy": {"enabled": False}, "serviceAccount": {"create": False}},
        {"auth": {"redisPassword": "r" * 12, "s3AccessKey": "a" * 12, "s3SecretKey": "s" * 12}},
    ],
    ids=["defaults", "no-netpol-no-sa", "given-credentials"],
)
def test_objects_validate_against_kubernetes_schemas(variant: dict[str, Any]) -> None:
    _validate_all(render_chart(variant))


def test_production_objects_validate_against_kubernetes_schemas(
    production_objects: list[dict[str, Any]],
) -> None:
    _validate_all(production_objects)


def _validate_all(objects: list[dict[str, Any]]) -> None:
    """Validate every object; a kind kubernetes-validate has no schema for and that is not
    in CUSTOM_KINDS raises SchemaNotFoundError, so nothing is skipped silently."""
    crd_schema = _ancerun_schema()
    how: dict[str, str] = {}
    for obj in objects:
        assert obj["metadata"]["name"], obj
        if obj["kind"] == "AnceRun":
            jsonschema.Draft7Validator(crd_schema).validate(obj)
            how[obj["kind"]] = "crd"
        elif obj["kind"] == "PyTorchJob":
            _validate_pytorchjob(obj)
            how[obj["kind"]] = "crd"
        elif obj["kind"] in KEDA_CRDS:
            _validate_keda(obj)
            how[obj["kind"]] = "crd"
        elif obj["kind"] == "ServiceMonitor":
            how[obj["kind"]] = "asserted"  # test_service_monitor_scrapes_every_ance_service
        else:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
            how[obj["kind"]] = "kubernetes"
    assert how["AnceRun"] == "crd"
    # The trainer is a Job, or with trainer.kubeflow.enabled a PyTorchJob.
    trainer_kind = "PyTorchJob" if "PyTorchJob" in how else "Job"
    assert how[trainer_kind] == ("crd" if trainer_kind == "PyTorchJob" else "kubernetes")
    assert {"CustomResourceDefinition", "Deployment", "Service", "ConfigMap", "Role",
            "RoleBinding"} <= {kind for kind, way in how.items() if way == "kubernetes"}
    assert {kind for kind, way in how.items() if way != "kubernetes"} <= CUSTOM_KINDS


@functools.cache
def _pytorchjob_schema() -> dict[str, Any]:
    """The fixture's openAPIV3Schema (parsed once: the CRD is 600 kB of YAML)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    (crd,) = [d for d in yaml.load_all(PYTORCHJOB_CRD.read_text(), Loader=loader) if d]
    assert crd["metadata"]["name"] == "pytorchjobs.kubeflow.org"
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1"
    return version["schema"]["openAPIV3Schema"]


def _undeclared(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields of ``value`` that ``schema`` does not declare: an API server prunes them from a
    custom resource without a word (structural schema pruning), so a misspelt field would be
    dropped silently."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found: list[str] = []
    if isinstance(value, dict) and schema.get("type") == "object":
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if properties is not None and key in properties:
                found += _undeclared(item, properties[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                found += _undeclared(item, extra, f"{path}.{key}")
            elif properties is not None:
                found.append(f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            found += _undeclared(item, schema["items"], f"{path}[{index}]")
    return found


def _validate_pytorchjob(job: dict[str, Any]) -> None:
    """The training operator's CRD schema (types, enums, required fields), no field it would
    prune, and each replica's pod template as a core/v1 PodTemplate (strict)."""
    schema = _pytorchjob_schema()
    jsonschema.Draft7Validator(schema).validate(job)
    assert _undeclared(job, schema) == []
    for replica_type, replica in job["spec"]["pytorchReplicaSpecs"].items():
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "PodTemplate",
             "metadata": {"name": f"{job['metadata']['name']}-{replica_type.lower()}"},
             "template": replica["template"]}, KUBE_VERSION, strict=True)


@functools.cache
def _keda_schema(kind: str) -> dict[str, Any]:
    """The openAPIV3Schema of KEDA's CRD for ``kind`` (keda.sh/v1alpha1), from its fixture."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    (crd,) = [d for d in yaml.load_all(KEDA_CRDS[kind].read_text(), Loader=loader) if d]
    assert crd["spec"]["group"] == "keda.sh" and crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    assert version["served"] and version["storage"]
    return version["schema"]["openAPIV3Schema"]


def _validate_keda(obj: dict[str, Any]) -> None:
    """KEDA's CRD schema (types, enums, required fields) and no field it would prune."""
    assert obj["apiVersion"] == "keda.sh/v1alpha1", obj["apiVersion"]
    schema = _keda_schema(obj["kind"])
    jsonschema.Draft7Validator(schema).validate(obj)
    assert _undeclared(obj, schema) == []


def _ancerun_schema() -> dict[str, Any]:
    (crd,) = render_crds()
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def test_invalid_kubernetes_object_is_rejected_by_the_validator(
    default_objects: list[dict[str, Any]],
) -> None:
    """The validator has teeth: a misspelt field in a rendered workload is refused."""
    for kind, role in (("Job", "trainer"), ("Deployment", "inferencer")):
        workload = one(default_objects, kind, f"{FULLNAME}-{role}")
        broken = yaml.safe_load(yaml.safe_dump(workload))
        broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBE_VERSION, strict=True)


def test_crd_matches_the_contract() -> None:
    (crd,) = render_crds()
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "anceruns.ance-train.io"
    assert spec["group"] == "ance-train.io"
    assert spec["scope"] == "Namespaced"
    assert spec["names"] == {"kind": "AnceRun", "listKind": "AnceRunList", "plural": "anceruns",
                             "singular": "ancerun", "shortNames": ["ar"]}
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}
    columns = [(c["name"], c["jsonPath"]) for c in version["additionalPrinterColumns"]]
    assert columns == [
        ("Phase", ".status.phase"), ("World", ".status.worldSize"), ("Step", ".status.step"),
        ("Loss", ".status.loss"),
        ("Checkpoint", ".status.latestCheckpoint"), ("Negatives", ".status.negativesStep"),
        ("Gap", ".status.asyncGap"), ("Refresh-s", ".status.refreshPeriodSeconds"),
        ("nDCG@10", ".status.ndcgAt10"), ("MRR@10", ".status.mrrAt10"),
        ("Age", ".metadata.creationTimestamp"),
    ]
    schema = version["schema"]["openAPIV3Schema"]["properties"]
    assert {k: v["type"] for k, v in schema["spec"]["properties"].items()} == {
        "runId": "string", "configMap": "string"}
    status = schema["status"]["properties"]
    assert {k: v["type"] for k, v in status.items()} == {
        "phase": "string", "message": "string", "step": "integer", "totalSteps": "integer",
        "worldSize": "integer", "loss": "number", "latestCheckpoint": "integer",
        "negativesStep": "integer",
        "asyncGap": "integer", "refreshPeriodSeconds": "number", "indexStep": "integer",
        "ndcgAt10": "number", "mrrAt10": "number", "evalStep": "integer", "updated": "string"}
    assert status["phase"]["enum"] == ["Pending", "Training", "Succeeded", "Failed"]
    assert "required" not in schema["status"]


def test_ancerun_status_schema_accepts_reports_and_rejects_bad_ones(
    default_objects: list[dict[str, Any]],
) -> None:
    validator = jsonschema.Draft7Validator(_ancerun_schema())
    run = one(default_objects, "AnceRun", FULLNAME)
    assert run["spec"] == {"runId": "ance-run", "configMap": f"{FULLNAME}-config"}
    reported = {**run, "status": {"phase": "Training", "step": 120, "totalSteps": 2000,
                                  "worldSize": 8, "loss": 0.42, "latestCheckpoint": 100,
                                  "negativesStep": 0,
                                  "asyncGap": 120, "refreshPeriodSeconds": 95.5,
                                  "ndcgAt10": 0.61, "mrrAt10": 0.58, "evalStep": 0,
                                  "indexStep": 0, "message": "ok", "updated": "now"}}
    validator.validate(reported)
    for bad in ({"phase": "Running"}, {"step": "12"}, {"loss": "low"}, {"worldSize": 0},
                {"worldSize": "8"}):
        assert not validator.is_valid({**run, "status": bad}), bad


# --------------------------------------------------------------------------- RBAC


def test_role_grants_exactly_the_contract(default_objects: list[dict[str, Any]]) -> None:
    role = one(default_objects, "Role", FULLNAME)
    granted = {(group, resource, verb)
               for rule in role["rules"]
               for group in rule["apiGroups"]
               for resource in rule["resources"]
               for verb in rule["verbs"]}
    assert granted == {
        ("ance-train.io", "anceruns", "get"),
        ("ance-train.io", "anceruns/status", "get"),
        ("ance-train.io", "anceruns/status", "patch"),
        ("", "events", "create"),
        ("", "events", "patch"),
    }
    for rule in role["rules"]:  # the AnceRun rules are narrowed to the release's own object
        if rule["apiGroups"] == ["ance-train.io"]:
            assert rule["resourceNames"] == [FULLNAME]
    assert not find(default_objects, "ClusterRole") + find(default_objects, "ClusterRoleBinding")

    binding = one(default_objects, "RoleBinding", FULLNAME)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": FULLNAME}
    (subject,) = binding["subjects"]
    one(default_objects, "ServiceAccount", subject["name"])
    assert subject["namespace"] == NAMESPACE
    for workload in ance_workloads(default_objects).values():
        assert pod_spec(workload)["serviceAccountName"] == subject["name"]
    for component in ("redis", "minio"):  # no API token where none is needed
        spec = pod_spec(one(default_objects, "StatefulSet", f"{FULLNAME}-{component}"))
        assert spec["automountServiceAccountToken"] is False
        assert "serviceAccountName" not in spec


# --------------------------------------------------------------------------- secrets


def _secret_values(objects: list[dict[str, Any]]) -> dict[str, str]:
    secret = one(objects, "Secret", f"{FULLNAME}-credentials")
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


@pytest.mark.parametrize(
    "auth",
    [{}, {"redisPassword": "redis-Pw-0123456789", "s3AccessKey": "AKIAEXAMPLE7Q",
          "s3SecretKey": "s3-Secret-abcdefghij0123456789"}],
    ids=["generated", "given"],
)
def test_secrets_stay_in_the_secret(auth: dict[str, str]) -> None:
    objects = render_chart({"auth": auth} if auth else None)
    values = _secret_values(objects)
    assert set(values) == {"redis-password", "s3-access-key", "s3-secret-key"}
    if auth:
        assert values == {"redis-password": auth["redisPassword"],
                          "s3-access-key": auth["s3AccessKey"],
                          "s3-secret-key": auth["s3SecretKey"]}
    else:  # generated: long random strings, different ones
        assert all(len(v) >= 20 and v.isalnum() for v in values.values()), values
        assert len(set(values.values())) == 3
    for obj in objects:
        if obj["kind"] == "Secret":
            continue
        text = yaml.safe_dump(obj)
        for key, value in values.items():
            assert value not in text, f"{key} appears in {obj['kind']} {obj['metadata']['name']}"
    assert len(all_workloads(objects)) == 5  # trainer Job, 2 Deployments, Redis, MinIO
    for workload in all_workloads(objects):
        for container in containers(workload):
            for name, item in env_of(container).items():
                if name in SECRET_ENV or name in {"REDIS_PASSWORD", "REDISCLI_AUTH",
                                                  "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"}:
                    assert "value" not in item and "secretKeyRef" in item["valueFrom"], item


def test_existing_secret_is_used_and_none_is_created(
    production_objects: list[dict[str, Any]],
) -> None:
    assert not find(production_objects, "Secret")
    for workload in ance_workloads(production_objects).values():
        for container in containers(workload):
            env = env_of(container)
            refs = {name: env[name]["valueFrom"]["secretKeyRef"] for name in SECRET_ENV}
            assert {n: (r["name"], r["key"]) for n, r in refs.items()} == {
                "ANCE_REDIS_PASSWORD": ("ance-credentials", "password"),
                "ANCE_S3_ACCESS_KEY": ("ance-credentials", "access-key"),
                "ANCE_S3_SECRET_KEY": ("ance-credentials", "secret-key"),
            }
            # Cluster mode refuses to start without any of them: none is optional.
            assert not any(ref.get("optional", False) for ref in refs.values())


def test_secret_is_kept_on_upgrade_via_lookup() -> None:
    """Upgrades reuse the live Secret's values (Helm ``lookup``); rendered without a cluster,
    lookup finds nothing and the values are generated, differently on every render."""
    template = (CHART_DIR / "templates" / "secret.yaml").read_text()
    assert re.search(r'lookup "v1" "Secret" \.Release\.Namespace', template)
    first, second = _secret_values(render_chart()), _secret_values(render_chart())
    assert first.keys() == second.keys()
    assert all(first[k] != second[k] for k in first)


# --------------------------------------------------------------------------- environment


def _services_source() -> str:
    files = (REPO_ROOT / "src" / "ance_train").rglob("*.py")
    return "\n".join(p.read_text() for p in files if "proto" not in p.parts)


def test_ance_env_matches_the_contract(default_objects: list[dict[str, Any]]) -> None:
    workloads = ance_workloads(default_objects)
    all_containers = [c for w in workloads.values() for c in containers(w)]
    # By default the dataset is in a bucket: the trainer pod waits for its upload first.
    assert [c["name"] for c in containers(workloads["trainer"])] == [
        "wait-for-data", "prepare", "trainer"]
    reference = env_of(all_containers[0])
    # prepare alone may reach the Hub (test_only_the_prepare_step_reaches_the_hub).
    hub_only = {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "HF_ENDPOINT", "HF_TOKEN"}
    for container in all_containers:
        env = env_of(container)
        if container["name"] == "prepare":
            env = {n: v for n, v in env.items() if n not in hub_only}
        assert env == reference, f"{container['name']} has a different environment"
        assert {n for n in env if n.startswith("ANCE_")} == CONTRACT_ENV

    env = reference
    assert env["ANCE_CONFIG"]["value"] == "/etc/ance/config.yaml"
    assert env["ANCE_REDIS_URL"]["value"] == f"redis://{FULLNAME}-redis:6379/0"
    one(default_objects, "Service", f"{FULLNAME}-redis")
    assert env["ANCE_S3_ENDPOINT"]["value"] == f"{FULLNAME}-minio:9000"
    one(default_objects, "Service", f"{FULLNAME}-minio")
    assert env["ANCE_S3_SECURE"]["value"] == "0"
    assert env["ANCE_S3_BUCKET"]["value"] == "ance-train"
    assert env["ANCE_WORK_DIR"]["value"] == "/work"
    assert env["ANCE_GRPC_HOST"]["value"] == "0.0.0.0"
    assert env["ANCE_GRPC_PORT"]["value"] == "50051"
    assert env["ANCE_METRICS_PORT"]["value"] == "9100"
    assert env["ANCE_CLUSTER_MODE"]["value"] == "1"
    assert env["HOME"]["value"] == "/tmp"
    assert env["ANCE_ANCERUN"]["value"] == one(default_objects, "AnceRun", FULLNAME)[
        "metadata"]["name"]
    field_refs = {n: env[n]["valueFrom"]["fieldRef"]["fieldPath"]
                  for n in ("POD_IP", "ANCE_INSTANCE", "ANCE_K8S_NAMESPACE")}
    assert field_refs == {"POD_IP": "status.podIP", "ANCE_INSTANCE": "metadata.name",
                          "ANCE_K8S_NAMESPACE": "metadata.namespace"}
    names = list(env)  # $(POD_IP) expands only if POD_IP is defined before it
    assert env["ANCE_ADVERTISE_ADDRESS"]["value"] == "$(POD_IP):50051"
    assert names.index("POD_IP") < names.index("ANCE_ADVERTISE_ADDRESS")


def test_every_ance_env_var_is_read_by_the_services(
    production_objects: list[dict[str, Any]],
) -> None:
    """Every ANCE_* variable the chart sets (extraEnv of the production values included) is
    named in src/ance_train/. Fails until the cluster-mode code reads each of them."""
    source = _services_source()
    set_by_chart = {name for w in ance_workloads(production_objects).values()
                    for c in containers(w) for name in env_of(c) if name.startswith("ANCE_")}
    assert CONTRACT_ENV | {"ANCE_LOG_LEVEL"} <= set_by_chart
    unread = sorted(n for n in set_by_chart if not re.search(rf"\b{n}\b", source))
    assert not unread, f"set by the chart but read nowhere in src/ance_train/: {unread}"


def test_external_endpoints(production_objects: list[dict[str, Any]]) -> None:
    kinds = {(o["kind"], o["metadata"]["name"]) for o in production_objects}
    assert not any(name.endswith(("-redis", "-minio")) for _, name in kinds), kinds
    env = env_of(pod_spec(ance_workloads(production_objects)["indexer"])["containers"][0])
    assert env["ANCE_REDIS_URL"]["value"] == "redis://redis.data.svc.cluster.local:6380/2"
    assert env["ANCE_S3_ENDPOINT"]["value"] == "s3.storage.example.internal:443"
    assert env["ANCE_S3_SECURE"]["value"] == "1"
    assert env["ANCE_S3_BUCKET"]["value"] == "ml-ance-runs"
    assert env["ANCE_LOG_LEVEL"]["value"] == "DEBUG"


# --------------------------------------------------------------------------- workloads


BILLION = Path(__file__).parents[1] / "helm" / "examples" / "values-billion.yaml"


def test_billion_document_values_render_the_planned_shape() -> None:
    """helm/examples/values-billion.yaml (docs/deployment.md): valid objects, a valid run
    configuration, and the pods the plan's bold row counts — 40 index partitions, 64
    inferencers, 2 × 8 trainer ranks, every indexer pod within 80 GB, no data volume."""
    objects = render_chart(values_files=[BILLION])
    _validate_all(objects)
    config = parse_config(yaml.safe_load(
        one(objects, "ConfigMap", f"{FULLNAME}-config")["data"]["config.yaml"]))
    assert config.data.path.startswith("s3://") and config.index.partitions == 40
    assert config.training.processes == 16 and config.inference.embedding_dtype == "float16"
    indexer = one(objects, "StatefulSet", f"{FULLNAME}-indexer")
    assert indexer["spec"]["replicas"] == 40
    inferencer = one(objects, "Deployment", f"{FULLNAME}-inferencer")
    trainer = one(objects, "Job", f"{FULLNAME}-trainer")
    assert inferencer["spec"]["replicas"] == 64 and trainer["spec"]["completions"] == 2
    assert containers(indexer)[0]["resources"]["limits"]["memory"] == "80Gi"
    for workload in (indexer, inferencer, trainer):
        assert "data" not in {v["name"] for v in pod_spec(workload)["volumes"]}


def test_run_config_is_valid_and_carries_the_run_id(
    default_objects: list[dict[str, Any]], production_objects: list[dict[str, Any]],
) -> None:
    for objects, run_id, data_path in (
            (default_objects, "ance-run", "s3://ance-data/scifact/"),  # no volume to create
            (production_objects, "msmarco-ance", "/data/msmarco")):  # data.existingClaim
        config_map = one(objects, "ConfigMap", f"{FULLNAME}-config")
        config = parse_config(yaml.safe_load(config_map["data"]["config.yaml"]))
        assert config.run_id == run_id
        assert config.data.path == data_path
        for workload in ance_workloads(objects).values():
            volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
            assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
            for container in containers(workload):
                mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
                assert mounts["/etc/ance"]["name"] == "config"


def test_roles_commands_and_strategies(default_objects: list[dict[str, Any]]) -> None:
    workloads = ance_workloads(default_objects)
    for role, workload in workloads.items():
        spec = pod_spec(workload)
        main = spec["containers"][0]
        assert main["args"] == ["serve", role]
        assert main["image"] == "ance-train:0.1.0"
        assert "command" not in main  # the image's ENTRYPOINT (ance-train) runs
    inits = {c["name"]: c for c in pod_spec(workloads["trainer"])["initContainers"]}
    assert inits["prepare"]["args"] == ["prepare"]
    # One indexer, never two at once (Recreate); the trainer's equivalent is its Job's
    # parallelism (test_trainer_is_a_job_that_runs_one_pod_to_completion).
    assert workloads["indexer"]["spec"]["replicas"] == 1
    assert workloads["indexer"]["spec"]["strategy"] == {"type": "Recreate"}
    assert "initContainers" not in pod_spec(workloads["inferencer"])
    assert "initContainers" not in pod_spec(workloads["indexer"])


def test_trainer_is_a_job_that_runs_one_pod_to_completion(
    default_objects: list[dict[str, Any]], production_objects: list[dict[str, Any]],
) -> None:
    defaults = yaml.safe_load((CHART_DIR / "values.yaml").read_text())["trainer"]
    assert 1 <= defaults["backoffLimit"] <= 10  # a few retries: each resumes from a checkpoint
    for objects in (default_objects, production_objects):
        name = f"{FULLNAME}-trainer"
        assert not find(objects, "Deployment", name) + find(objects, "StatefulSet", name)
        job = one(objects, "Job", name)
        assert job["apiVersion"] == "batch/v1"
        spec = job["spec"]
        assert (spec["completions"], spec["parallelism"]) == (1, 1)  # never two trainers
        assert spec["backoffLimit"] == defaults["backoffLimit"]
        assert not {"ttlSecondsAfterFinished", "activeDeadlineSeconds"} & set(spec)
        # Kubernetes generates the Job's selector (a unique controller-uid label).
        assert not {"selector", "manualSelector"} & set(spec)
        # A retry is a new pod, created once the failed one has terminated (what a pod failure
        # policy implies); pods the cluster disrupts are retried without using up backoffLimit.
        assert pod_spec(job)["restartPolicy"] == "Never"
        assert spec["podFailurePolicy"] == {"rules": [{
            "action": "Ignore",
            "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]}
        # wait-for-data only with the dataset in a bucket (the default; not production's PVC).
        assert [c["name"] for c in containers(job)] == [
            *(["wait-for-data"] if objects is default_objects else []), "prepare", "trainer"]
        assert pod_labels(job)["ance-train.io/service"] == "true"  # NetworkPolicy, Service


@pytest.mark.parametrize(
    ("trainer", "expected"),
    [
        ({"backoffLimit": 0}, {"backoffLimit": 0}),
        ({"backoffLimit": 7, "activeDeadlineSeconds": 259200, "ttlSecondsAfterFinished": 0},
         {"backoffLimit": 7, "activeDeadlineSeconds": 259200, "ttlSecondsAfterFinished": 0}),
        ({"ttlSecondsAfterFinished": 604800},
         {"backoffLimit": 4, "ttlSecondsAfterFinished": 604800}),
    ],
    ids=["no-retry", "all-set", "ttl-only"],
)
def test_trainer_job_settings_from_values(
    trainer: dict[str, int], expected: dict[str, int],
) -> None:
    job = one(render_chart({"trainer": trainer}), "Job", f"{FULLNAME}-trainer")
    settings = ("backoffLimit", "activeDeadlineSeconds", "ttlSecondsAfterFinished")
    assert {k: job["spec"][k] for k in settings if k in job["spec"]} == expected
    assert (job["spec"]["completions"], job["spec"]["parallelism"]) == (1, 1)
    kubernetes_validate.validate(job, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("replicas", [0, 1, 7])
def test_inferencer_replicas_follow_values(replicas: int) -> None:
    objects = render_chart({"inferencer": {"replicas": replicas}})
    assert one(objects, "Deployment", f"{FULLNAME}-inferencer")["spec"]["replicas"] == replicas
    assert one(objects, "Deployment", f"{FULLNAME}-indexer")["spec"]["replicas"] == 1
    assert one(objects, "Job", f"{FULLNAME}-trainer")["spec"]["parallelism"] == 1
    assert f"inferencer ×{replicas}," in render_notes({"inferencer": {"replicas": replicas}})


PARTITIONS = {"run": {"config": {"index": {"partitions": 3}}}}


def test_index_partitions_render_a_statefulset_whose_ordinal_is_the_partition(
    default_objects: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """index.partitions P > 1: P indexer pods of a StatefulSet, started together; each pod's
    name ends in its ordinal, which the service takes as its partition."""
    assert lint_chart(PARTITIONS).ok
    objects = render_chart(PARTITIONS)
    _validate_all(objects)
    assert not find(objects, "Deployment", f"{FULLNAME}-indexer")
    indexer = one(objects, "StatefulSet", f"{FULLNAME}-indexer")
    spec = indexer["spec"]
    assert (spec["replicas"], spec["podManagementPolicy"]) == (3, "Parallel")
    service = one(objects, "Service", f"{FULLNAME}-indexer")
    assert spec["serviceName"] == service["metadata"]["name"]
    assert selects(service["spec"]["selector"], pod_labels(indexer))
    env = env_of(pod_spec(indexer)["containers"][0])
    assert env["ANCE_INSTANCE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    monkeypatch.delenv(PARTITION_VAR, raising=False)
    assert [partition_number(f"{FULLNAME}-indexer-{ordinal}", 3) for ordinal in range(3)] == [
        0, 1, 2]
    config = yaml.safe_load(one(objects, "ConfigMap", f"{FULLNAME}-config")["data"][
        "config.yaml"])
    assert parse_config(config).index.partitions == 3
    # The pod is the one indexer's pod; only the workload around it changes.
    single = one(default_objects, "Deployment", f"{FULLNAME}-indexer")
    assert pod_spec(indexer) == pod_spec(single)


# Kinds a template spells out for other values than the defaults (the indexer's partitions).
OTHER_KINDS = {"indexer.yaml": ["StatefulSet"]}


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("trainer.yaml", [("Job", "trainer"), ("Service", "trainer")]),
        ("inferencer.yaml", [("Deployment", "inferencer"), ("Service", "inferencer")]),
        ("indexer.yaml", [("Deployment", "indexer"), ("Service", "indexer")]),
        ("redis.yaml", [("Service", "redis"), ("StatefulSet", "redis")]),
        ("minio.yaml", [("Service", "minio"), ("StatefulSet", "minio")]),
    ],
)
def test_each_workload_is_written_out_in_its_own_template(
    template: str, expected: list[tuple[str, str]],
) -> None:
    """Each workload's manifest is readable in its own file (as `helm create` writes them):
    its kinds and the shape of its pod spelled out there, not generated by a helper — but for
    the trainer's pod, shared by the Job and the PyTorchJob: spelled out once, in
    _trainer-pod.tpl, which trainer.yaml renders (test_trainer_pod_is_written_once)."""
    source = (CHART_DIR / "templates" / template).read_text()
    if template == "trainer.yaml":
        assert 'include "ance-train.trainerPod"' in source
        source += (CHART_DIR / "templates" / "_trainer-pod.tpl").read_text()
    kinds = re.findall(r"^kind: (\w+)$", source, re.M)
    assert [k for k in kinds if k not in OTHER_KINDS.get(template, [])] == [
        kind for kind, _ in expected]
    assert [k for k in kinds if k in OTHER_KINDS.get(template, [])] == OTHER_KINDS.get(
        template, [])
    for key in ("apiVersion:", "metadata:", "spec:", "template:", "containers:", "image:",
                "ports:", "volumeMounts:", "securityContext:", "resources:"):
        assert key in source, f"{template} lacks {key}"
    rendered = next(text for path, text in render_manifests().items()
                    if path.endswith(f"/templates/{template}"))
    assert [(o["kind"], o["metadata"]["name"]) for o in yaml.safe_load_all(rendered) if o] == [
        (kind, f"{FULLNAME}-{role}") for kind, role in expected]


def test_helpers_are_small_and_render_no_object() -> None:
    """_helpers.tpl keeps only short shared pieces: no helper renders a whole object."""
    text = (CHART_DIR / "templates" / "_helpers.tpl").read_text()
    helpers = re.split(r'^\{\{-? define "', text, flags=re.M)[1:]
    assert len(helpers) >= 10
    for helper in helpers:
        name, body = helper.split('"', 1)
        assert not re.search(r"^\s*(apiVersion|kind|template|containers):", body, re.M), name
        assert body.count("\n") <= 60, f"{name}: {body.count(chr(10))} lines"
    for workload in ("deployment", "statefulset", "job", "service"):
        assert f'"ance-train.{workload}"' not in text


def test_security_context_of_every_container(
    default_objects: list[dict[str, Any]], production_objects: list[dict[str, Any]],
) -> None:
    checked = 0
    for objects in (default_objects, production_objects):
        for workload in all_workloads(objects):
            spec = pod_spec(workload)
            pod_ctx = spec.get("securityContext", {})
            assert pod_ctx.get("seccompProfile") == {"type": "RuntimeDefault"}
            for container in containers(workload):
                ctx = {**pod_ctx, **container["securityContext"]}
                where = f"{workload['metadata']['name']}/{container['name']}"
                assert ctx["runAsNonRoot"] is True, where
                assert isinstance(ctx["runAsUser"], int) and ctx["runAsUser"] > 0, where
                assert container["securityContext"]["readOnlyRootFilesystem"] is True, where
                assert container["securityContext"]["allowPrivilegeEscalation"] is False, where
                assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}, where
                assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, where
                mounts = {m["mountPath"] for m in container["volumeMounts"]}
                assert "/tmp" in mounts, where  # writable scratch beside a read-only root
                checked += 1
    # defaults: 5 ance containers (wait-for-data, prepare, trainer, inferencer, indexer) +
    # redis + minio; production (the dataset on a volume: no wait-for-data): 4.
    assert checked == 7 + 4


def test_scratch_and_data_volumes(production_objects: list[dict[str, Any]]) -> None:
    for workload in ance_workloads(production_objects).values():
        volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
        assert volumes["work"]["emptyDir"] == {"sizeLimit": "200Gi"}
        assert "emptyDir" in volumes["tmp"]
        assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "msmarco",
                                                            "readOnly": True}
        for container in containers(workload):
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            assert mounts["/work"]["name"] == "work"
            assert mounts["/tmp"]["name"] == "tmp"
            assert mounts["/data"] == {"name": "data", "mountPath": "/data", "readOnly": True,
                                       "subPath": "datasets"}


def test_grpc_probes_ports_and_services(default_objects: list[dict[str, Any]]) -> None:
    for role, workload in ance_workloads(default_objects).items():
        main = pod_spec(workload)["containers"][0]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert main[probe]["grpc"] == {"port": 50051}, (role, probe)
        ports = {p["name"]: p["containerPort"] for p in main["ports"]}
        assert ports == {"grpc": 50051, "metrics": 9100}
        service = one(default_objects, "Service", f"{FULLNAME}-{role}")
        assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(workload))
        others = [w for r, w in ance_workloads(default_objects).items() if r != role]
        assert not any(selects({"matchLabels": service["spec"]["selector"]}, pod_labels(w))
                       for w in others)
        service_ports = {p["name"]: (p["port"], p["targetPort"])
                         for p in service["spec"]["ports"]}
        assert service_ports == {"grpc": (50051, "grpc"), "metrics": (9100, "metrics")}


def test_inferencer_replicas_from_values_and_scaling_changes_nothing_else() -> None:
    two = render_chart({"inferencer": {"replicas": 2}})
    four = render_chart({"inferencer": {"replicas": 4}})
    name = f"{FULLNAME}-inferencer"
    assert one(two, "Deployment", name)["spec"]["replicas"] == 2
    assert one(four, "Deployment", name)["spec"]["replicas"] == 4
    # kubectl scale (or an upgrade that only changes replicas) must not restart any pod:
    # the pod templates, config checksum annotation included, are identical.
    assert one(two, "Deployment", name)["spec"]["template"] == one(
        four, "Deployment", name)["spec"]["template"]
    assert "checksum/config" in one(two, "Deployment", name)["spec"]["template"]["metadata"][
        "annotations"]

    def comparable(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # The generated Secret differs on every render (random); the replica count by design.
        kept = [o for o in objects if o["kind"] != "Secret"]
        for obj in kept:
            if obj["kind"] == "Deployment" and obj["metadata"]["name"] == name:
                obj["spec"]["replicas"] = None
        return kept

    assert comparable(two) == comparable(four)


def test_gpus_node_selectors_tolerations(
    default_objects: list[dict[str, Any]], production_objects: list[dict[str, Any]],
) -> None:
    production = ance_workloads(production_objects)
    values = yaml.safe_load(PRODUCTION.read_text())
    for role, gpus in (("trainer", 4), ("inferencer", 1), ("indexer", 1)):
        spec = pod_spec(production[role])
        resources = spec["containers"][0]["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == gpus
        assert resources["requests"]["nvidia.com/gpu"] == gpus
        assert spec["nodeSelector"] == values[role]["nodeSelector"]
        assert spec["tolerations"] == values[role]["tolerations"]
    assert pod_spec(production["inferencer"])["affinity"] == values["inferencer"]["affinity"]
    assert production["inferencer"]["spec"]["replicas"] == 4
    assert pod_spec(production["trainer"])["containers"][0]["resources"]["requests"][
        "memory"] == "128Gi"
    defaults = ance_workloads(default_objects)
    assert pod_spec(defaults["indexer"])["containers"][0]["resources"]["limits"].get(
        "nvidia.com/gpu") is None
    assert pod_spec(defaults["inferencer"])["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"] == 1
    assert "nodeSelector" not in pod_spec(defaults["trainer"])


def test_redis_persists_streams_and_minio_has_a_volume(
    default_objects: list[dict[str, Any]],
) -> None:
    redis = one(default_objects, "StatefulSet", f"{FULLNAME}-redis")
    container = pod_spec(redis)["containers"][0]
    args = " ".join(container["args"])
    for flag in ("--appendonly yes", "--appendfsync always", "--requirepass $(REDIS_PASSWORD)",
                 "--dir /data"):
        assert flag in args
    assert env_of(container)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": f"{FULLNAME}-credentials", "key": "redis-password"}
    minio = one(default_objects, "StatefulSet", f"{FULLNAME}-minio")
    minio_env = env_of(pod_spec(minio)["containers"][0])
    assert minio_env["MINIO_ROOT_USER"]["valueFrom"]["secretKeyRef"]["key"] == "s3-access-key"
    assert minio_env["MINIO_ROOT_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "s3-secret-key"
    for workload in (redis, minio):
        (claim,) = workload["spec"]["volumeClaimTemplates"]
        assert claim["metadata"]["name"] == "data"
        # Labelled, so that `kubectl delete pvc -l app.kubernetes.io/instance=...` finds them.
        assert claim["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
        mounts = {m["name"]: m["mountPath"] for m in pod_spec(workload)["containers"][0][
            "volumeMounts"]}
        assert mounts["data"] == "/data"
        one(default_objects, "Service", workload["spec"]["serviceName"])


# --------------------------------------------------------------------------- network


def _rule_ports(rule: dict[str, Any]) -> set[tuple[int, str]]:
    return {(int(p["port"]), p.get("protocol", "TCP")) for p in rule.get("ports", [])}


def test_network_policy_allows_only_what_the_system_needs(
    default_objects: list[dict[str, Any]],
) -> None:
    workloads = {name: w for name, w in ance_workloads(default_objects).items()}
    redis = one(default_objects, "StatefulSet", f"{FULLNAME}-redis")
    minio = one(default_objects, "StatefulSet", f"{FULLNAME}-minio")
    policy = one(default_objects, "NetworkPolicy", f"{FULLNAME}-services")
    spec = policy["spec"]
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"}
    assert all(selects(spec["podSelector"], pod_labels(w)) for w in workloads.values())
    assert not any(selects(spec["podSelector"], pod_labels(w)) for w in (redis, minio))

    ingress = {frozenset(_rule_ports(r)): r["from"] for r in spec["ingress"]}
    assert set(ingress) == {frozenset({(50051, "TCP")}), frozenset({(9100, "TCP")})}
    (grpc_peer,) = ingress[frozenset({(50051, "TCP")})]
    assert set(grpc_peer) == {"podSelector"}
    assert all(selects(grpc_peer["podSelector"], pod_labels(w)) for w in workloads.values())
    (metrics_peer,) = ingress[frozenset({(9100, "TCP")})]
    assert metrics_peer["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}

    egress = {frozenset(_rule_ports(r)): r.get("to") for r in spec["egress"]}
    assert set(egress) == {
        frozenset({(50051, "TCP")}), frozenset({(6379, "TCP")}), frozenset({(9000, "TCP")}),
        frozenset({(53, "UDP"), (53, "TCP")}), frozenset({(443, "TCP"), (6443, "TCP")}),
    }
    (to_redis,) = egress[frozenset({(6379, "TCP")})]
    assert selects(to_redis["podSelector"], pod_labels(redis))
    (to_minio,) = egress[frozenset({(9000, "TCP")})]
    assert selects(to_minio["podSelector"], pod_labels(minio))
    assert egress[frozenset({(443, "TCP"), (6443, "TCP")})] == [{"ipBlock": {"cidr": "0.0.0.0/0"}}]

    for workload, port in ((redis, 6379), (minio, 9000)):
        name = workload["metadata"]["name"]
        store = one(default_objects, "NetworkPolicy", name)["spec"]
        assert selects(store["podSelector"], pod_labels(workload))
        (rule,) = store["ingress"]
        assert _rule_ports(rule) == {(port, "TCP")}
        (peer,) = rule["from"]
        assert all(selects(peer["podSelector"], pod_labels(w)) for w in workloads.values())
        assert not selects(peer["podSelector"], pod_labels(workload))
        assert [_rule_ports(r) for r in store["egress"]] == [{(53, "UDP"), (53, "TCP")}]

    assert not find(render_chart({"networkPolicy": {"enabled": False}}), "NetworkPolicy")


def test_network_policy_with_external_endpoints(production_objects: list[dict[str, Any]]) -> None:
    (policy,) = find(production_objects, "NetworkPolicy")
    spec = policy["spec"]
    egress = {frozenset(_rule_ports(r)): r.get("to") for r in spec["egress"]}
    external = [{"ipBlock": {"cidr": "10.40.0.0/16"}}]
    assert egress[frozenset({(6380, "TCP")})] == external
    assert egress[frozenset({(443, "TCP")})] == external
    assert egress[frozenset({(443, "TCP"), (6443, "TCP")})] == [
        {"ipBlock": {"cidr": "10.96.0.1/32"}}, {"ipBlock": {"cidr": "172.20.0.0/16"}}]
    (metrics_rule,) = [r for r in spec["ingress"] if _rule_ports(r) == {(9100, "TCP")}]
    assert metrics_rule["from"] == [{
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }]


def test_service_monitor_scrapes_every_ance_service(
    default_objects: list[dict[str, Any]], production_objects: list[dict[str, Any]],
) -> None:
    assert not find(default_objects, "ServiceMonitor")
    monitor = one(production_objects, "ServiceMonitor", FULLNAME)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert spec["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    selected = [s["metadata"]["name"] for s in find(production_objects, "Service")
                if selects(spec["selector"], s["metadata"]["labels"])]
    assert sorted(selected) == sorted(f"{FULLNAME}-{role}" for role in ROLES)
    for name in selected:
        ports = one(production_objects, "Service", name)["spec"]["ports"]
        assert {"metrics"} <= {p["name"] for p in ports}


def test_notes_tell_how_to_watch_the_run() -> None:
    notes = render_notes()
    for line in (
        f"kubectl -n {NAMESPACE} get anceruns -w",
        "get events --field-selector involvedObject.kind=AnceRun",
        f"logs -f job/{FULLNAME}-trainer",
        f"get job {FULLNAME}-trainer -w",
        f"scale deploy/{FULLNAME}-inferencer --replicas=",
        f"port-forward svc/{FULLNAME}-minio 9000:9000",
        "ance-train status --run-id ance-run",
        "ance-train search --run-id ance-run",
    ):
        assert line in notes, line


# --------------------------------------------------------------------------- trainer ranks

RANKS = {"trainer": {"nodes": 2, "procsPerNode": 4, "gpus": 4,
                     "ncclEnv": {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": 1}}}
RANKS_SERVICE = f"{FULLNAME}-ranks"


@pytest.fixture(scope="module")
def ranks_objects() -> list[dict[str, Any]]:
    return render_chart(RANKS)


def _flag(command: list[str], name: str) -> str:
    assert command.count(name) == 1, (name, command)
    return command[command.index(name) + 1]


def _flags(command: list[str]) -> set[str]:
    return {arg for arg in command if arg.startswith("--")}


def test_trainer_ranks_lint_strict_passes() -> None:
    result = lint_chart(RANKS)
    assert result.ok, result.errors


def test_default_trainer_is_one_process_as_before(default_objects: list[dict[str, Any]]) -> None:
    job = one(default_objects, "Job", f"{FULLNAME}-trainer")
    spec = job["spec"]
    assert "completionMode" not in spec
    assert (spec["completions"], spec["parallelism"]) == (1, 1)
    assert "subdomain" not in pod_spec(job)
    main = pod_spec(job)["containers"][0]
    assert "command" not in main and main["args"] == ["serve", "trainer"]
    assert not any(k.startswith("NCCL_") for k in env_of(main))
    assert "/dev/shm" not in {m["mountPath"] for m in main["volumeMounts"]}
    assert not find(default_objects, "Service", RANKS_SERVICE)
    assert not find(default_objects, "NetworkPolicy", f"{FULLNAME}-trainer-ranks")
    config = yaml.safe_load(one(default_objects, "ConfigMap", f"{FULLNAME}-config")["data"][
        "config.yaml"])
    assert "processes" not in config["training"]


def test_trainer_ranks_indexed_job_headless_service_and_torchrun(
    ranks_objects: list[dict[str, Any]],
) -> None:
    job = one(ranks_objects, "Job", f"{FULLNAME}-trainer")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert (spec["completions"], spec["parallelism"]) == (2, 2)
    assert spec["backoffLimit"] == 4
    service = one(ranks_objects, "Service", RANKS_SERVICE)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(job))
    others = [w for r, w in ance_workloads(ranks_objects).items() if r != "trainer"]
    assert not any(selects({"matchLabels": service["spec"]["selector"]}, pod_labels(w))
                   for w in others)
    assert pod_spec(job)["subdomain"] == RANKS_SERVICE

    main = pod_spec(job)["containers"][0]
    command = main["command"]
    assert command[:3] == ["python", "-m", "torch.distributed.run"]
    assert _flag(command, "--nnodes") == "2"
    assert _flag(command, "--nproc-per-node") == "4"
    assert _flag(command, "--node-rank") == "$(JOB_COMPLETION_INDEX)"
    assert _flag(command, "--rdzv-backend") == "c10d"
    # Pod 0 of the Indexed Job, by its hostname under the headless Service.
    assert _flag(command, "--rdzv-endpoint") == f"{FULLNAME}-trainer-0.{RANKS_SERVICE}:29400"
    assert _flag(command, "--rdzv-id") == RELEASE
    assert _flag(command, "--max-restarts") == "3"
    assert _flag(command, "--rdzv-conf") == "join_timeout=900"  # trainer.rdzvJoinTimeout
    assert "--master-addr" not in command and "--master-port" not in command
    assert command[-2:] == ["-m", "ance_train.cli"]
    assert main["args"] == ["serve", "trainer"]

    env = env_of(main)
    assert env["NCCL_SOCKET_IFNAME"]["value"] == "eth0"
    assert env["NCCL_IB_DISABLE"]["value"] == "1"
    assert set(env) >= CONTRACT_ENV
    assert not any(k.startswith("NCCL_") for k in env_of(pod_spec(job)["initContainers"][0]))
    (shm,) = [v for v in pod_spec(job)["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
    assert mounts["/dev/shm"] == "dshm"
    assert main["resources"]["requests"]["nvidia.com/gpu"] == 4  # per pod
    # Only pod 0 runs global rank 0, which serves gRPC: no gRPC probes on the other pods, and
    # the trainer's Service sends Status / metrics to pod 0 only.
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(main)
    grpc_service = one(ranks_objects, "Service", f"{FULLNAME}-trainer")
    assert grpc_service["spec"]["selector"]["batch.kubernetes.io/job-completion-index"] == "0"

    config = parse_config(yaml.safe_load(
        one(ranks_objects, "ConfigMap", f"{FULLNAME}-config")["data"]["config.yaml"]))
    assert config.training.processes == 8
    _validate_all(ranks_objects)


def test_trainer_ranks_within_one_pod_keep_probes() -> None:
    objects = render_chart({"trainer": {"procsPerNode": 2, "gpus": 2, "maxRestarts": 0}})
    job = one(objects, "Job", f"{FULLNAME}-trainer")
    assert job["spec"]["completionMode"] == "Indexed"
    assert (job["spec"]["completions"], job["spec"]["parallelism"]) == (1, 1)
    main = pod_spec(job)["containers"][0]
    assert _flag(main["command"], "--nnodes") == "1"
    assert _flag(main["command"], "--nproc-per-node") == "2"
    assert _flag(main["command"], "--max-restarts") == "0"
    assert main["readinessProbe"]["grpc"] == {"port": 50051}  # pod 0 holds rank 0
    service = one(objects, "Service", f"{FULLNAME}-trainer")
    assert "batch.kubernetes.io/job-completion-index" not in service["spec"]["selector"]
    one(objects, "Service", RANKS_SERVICE)
    _validate_all(objects)


def test_trainer_ranks_command_matches_the_embedded_launcher(
    ranks_objects: list[dict[str, Any]],
) -> None:
    """Cluster and embedded mode start the same rank code with the same launcher flags; only
    where the c10d rendezvous is differs (pod 0 here, 127.0.0.1 there)."""
    embedded = [*service_command("trainer", 4).argv, "serve", "trainer"]
    main = pod_spec(one(ranks_objects, "Job", f"{FULLNAME}-trainer"))["containers"][0]
    rendered = [*main["command"], *main["args"]]
    assert embedded[1:3] == rendered[1:3] == ["-m", "torch.distributed.run"]
    assert _flag(embedded, "--nproc-per-node") == "4" == _flag(rendered, "--nproc-per-node")
    assert _flag(embedded, "--nnodes") == "1"
    tail = ["-m", "ance_train.cli", "serve", "trainer"]
    assert embedded[-4:] == rendered[-4:] == tail
    assert rendered.count("-m") == embedded.count("-m") == 2
    # Every flag name the embedded launcher passes is passed here.
    assert _flags(embedded) <= _flags(rendered)
    assert _flag(embedded, "--rdzv-backend") == "c10d" == _flag(rendered, "--rdzv-backend")
    # And the single-process trainer: the same module as `python -m ance_train.cli`.
    assert service_command("trainer", 1).argv[1:] == ["-m", "ance_train.cli"]


def test_trainer_ranks_get_the_environment_the_embedded_ranks_get(
    ranks_objects: list[dict[str, Any]], kubeflow_objects: list[dict[str, Any]],
    default_objects: list[dict[str, Any]],
) -> None:
    """torchrun restarts a group (--max-restarts) only with RANKS_ENV (a fresh rendezvous
    store per group: launcher/embedded.py); the chart's ranks get the same, a single-process
    trainer does not need it."""
    def env(container: dict[str, Any]) -> dict[str, str]:
        return {e["name"]: e.get("value") for e in container.get("env", [])}

    job = pod_spec(one(ranks_objects, "Job", f"{FULLNAME}-trainer"))["containers"][0]
    pytorchjob = one(kubeflow_objects, "PyTorchJob", f"{FULLNAME}-trainer")
    containers = [job] + [_pytorch_container(pytorchjob, replica) for replica
                          in pytorchjob["spec"]["pytorchReplicaSpecs"]]
    for container in containers:
        assert RANKS_ENV.items() <= env(container).items(), container["name"]
    single = pod_spec(one(default_objects, "Job", f"{FULLNAME}-trainer"))["containers"][0]
    assert not RANKS_ENV.keys() & env(single).keys()


def test_trainer_ranks_network_policy(ranks_objects: list[dict[str, Any]]) -> None:
    job = one(ranks_objects, "Job", f"{FULLNAME}-trainer")
    policy = one(ranks_objects, "NetworkPolicy", f"{FULLNAME}-trainer-ranks")["spec"]
    assert selects(policy["podSelector"], pod_labels(job))
    assert not any(selects(policy["podSelector"], pod_labels(w))
                   for r, w in ance_workloads(ranks_objects).items() if r != "trainer")
    (ingress,) = policy["ingress"]
    (egress,) = policy["egress"]
    # All ports: rendezvous, the process group's store and NCCL sockets use ports picked at run
    # time; only trainer pods, both ways.
    assert "ports" not in ingress and "ports" not in egress
    for (peer,) in (ingress["from"], egress["to"]):
        assert set(peer) == {"podSelector"}
        assert selects(peer["podSelector"], pod_labels(job))
        assert not any(selects(peer["podSelector"], pod_labels(w))
                       for r, w in ance_workloads(ranks_objects).items() if r != "trainer")
    # The services' policy is unchanged.
    services = one(ranks_objects, "NetworkPolicy", f"{FULLNAME}-services")
    assert services == one(render_chart(), "NetworkPolicy", f"{FULLNAME}-services")
    no_policy = render_chart({**RANKS, "networkPolicy": {"enabled": False}})
    assert not find(no_policy, "NetworkPolicy")


@pytest.mark.parametrize(
    ("trainer", "field"),
    [
        ({"nodes": 0}, "/trainer/nodes"),
        ({"nodes": 1.5}, "/trainer/nodes"),
        ({"procsPerNode": 0}, "/trainer/procsPerNode"),
        ({"maxRestarts": -1}, "/trainer/maxRestarts"),
        ({"shmSize": "lots"}, "/trainer/shmSize"),
        ({"ncclEnv": {"GLOO_SOCKET_IFNAME": "eth0"}}, "GLOO_SOCKET_IFNAME"),
        ({"ncclEnv": {"nccl_debug": "INFO"}}, "nccl_debug"),
    ],
)
def test_values_schema_rejects_bad_trainer_ranks(trainer: dict[str, Any], field: str) -> None:
    with pytest.raises(HelmError) as failure:
        render_manifests({"trainer": trainer})
    message = str(failure.value)
    assert "schema" in message or "at '" in message, message
    assert field in message, message


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"trainer": {"nodes": 2}, "run": {"config": {"training": {"processes": 4}}}},
         "training.processes is 4"),
        ({"trainer": {"procsPerNode": 4, "gpus": 2}}, "trainer.gpus is 2"),
    ],
    ids=["processes-disagree", "too-few-gpus"],
)
def test_trainer_ranks_inconsistent_values_fail_the_render(
    values: dict[str, Any], expected: str,
) -> None:
    with pytest.raises(HelmError) as failure:
        render_manifests(values)
    assert expected in str(failure.value), str(failure.value)


def test_run_config_processes_set_equal_to_the_ranks_is_kept() -> None:
    objects = render_chart({"trainer": {"nodes": 3, "gpus": 0},
                            "run": {"config": {"training": {"processes": 3}}}})
    config = yaml.safe_load(one(objects, "ConfigMap", f"{FULLNAME}-config")["data"][
        "config.yaml"])
    assert config["training"]["processes"] == 3
    assert one(objects, "Job", f"{FULLNAME}-trainer")["spec"]["completions"] == 3


# --------------------------------------------------------------------------- Kubeflow PyTorchJob

KUBEFLOW = {"trainer": {**RANKS["trainer"], "kubeflow": {"enabled": True}}}
TRAINER = f"{FULLNAME}-trainer"
# Labels the training operator puts on the pods of a PyTorchJob (release v1.9.0,
# pkg/apis/kubeflow.org/v1/common_types.go: replica type lower-cased, index as a string).
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"


@pytest.fixture(scope="module")
def kubeflow_objects() -> list[dict[str, Any]]:
    return render_chart(KUBEFLOW)


def _pytorch_container(job: dict[str, Any], replica_type: str) -> dict[str, Any]:
    spec = job["spec"]["pytorchReplicaSpecs"][replica_type]["template"]["spec"]
    (container,) = [c for c in spec["containers"] if c["name"] == "pytorch"]
    return container


def operator_env(job: dict[str, Any], replica_type: str, index: int) -> dict[str, str]:
    """The variables the training operator adds to the `pytorch` container of replica
    ``replica_type``/``index`` of ``job``, by the rules of its release v1.9.0 (the CRD fixture's):
    pkg/controller.v1/pytorch/envvar.go (setPodEnv), master.go and elastic.go. No operator can
    run here; this follows that code for the fields a PyTorchJob can set."""
    spec, name = job["spec"], job["metadata"]["name"]
    replicas = spec["pytorchReplicaSpecs"]

    def port(rtype: str) -> int:
        return next(p["containerPort"] for p in _pytorch_container(job, rtype)["ports"]
                    if p["name"] == "pytorchjob-port")

    total = sum(r["replicas"] for r in replicas.values())
    env = {"PYTHONUNBUFFERED": "1"}
    if "Master" in replicas:
        rank = index + (1 if replica_type == "Worker" else 0)
        nproc = int(spec["nprocPerNode"]) if spec.get("nprocPerNode", "").isdigit() else 1
        env |= {"MASTER_PORT": str(port("Master")), "PET_MASTER_PORT": str(port("Master")),
                "MASTER_ADDR": f"{name}-master-0", "PET_MASTER_ADDR": f"{name}-master-0",
                "WORLD_SIZE": str(total * nproc), "RANK": str(rank),
                "PET_NODE_RANK": str(rank)}
    if "nprocPerNode" in spec:
        env["PET_NPROC_PER_NODE"] = spec["nprocPerNode"]
    elastic = spec.get("elasticPolicy")
    if elastic is None:
        env["PET_NNODES"] = str(total)
        return env
    env["PET_RDZV_ENDPOINT"] = (f"{elastic.get('rdzvHost', f'{name}-worker-0')}:"
                                f"{elastic.get('rdzvPort', port('Worker'))}")
    env["PET_RDZV_BACKEND"] = elastic.get("rdzvBackend", "c10d")
    if "minReplicas" in elastic or "maxReplicas" in elastic:
        env["PET_NNODES"] = f"{elastic['minReplicas']}:{elastic['maxReplicas']}"
    else:
        env["PET_NNODES"] = str(replicas["Worker"]["replicas"])
    if "maxRestarts" in elastic:
        env["PET_MAX_RESTARTS"] = str(elastic["maxRestarts"])
    if "rdzvId" in elastic:
        env["PET_RDZV_ID"] = elastic["rdzvId"]
    if elastic.get("rdzvConf"):
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in elastic["rdzvConf"])
    return env


def _launch(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
            tmp_path: Path) -> dict[str, Any]:
    """What ``python -m torch.distributed.run ...`` (``argv``) launches in a process whose
    environment is ``env``: torchrun's own argument parser (which takes the default of each
    flag from its PET_* variable) and launch configuration."""
    import tempfile

    from torch.distributed import run as torchrun

    assert argv[:3] == ["python", "-m", "torch.distributed.run"], argv
    with monkeypatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("PET_")]:
            patch.delenv(name)
        for name, value in {**env, "OMP_NUM_THREADS": "1"}.items():
            patch.setenv(name, value)
        patch.setattr(tempfile, "tempdir", str(tmp_path))  # torchrun's log directory
        config, _, cmd_args = torchrun.config_from_args(torchrun.parse_args(argv[3:]))
    return {"nodes": (config.min_nodes, config.max_nodes),
            "nproc_per_node": config.nproc_per_node, "run_id": config.run_id,
            "rdzv_backend": config.rdzv_backend, "rdzv_endpoint": config.rdzv_endpoint,
            "rdzv_configs": dict(config.rdzv_configs), "max_restarts": config.max_restarts,
            "role": config.role, "start_method": config.start_method,
            "monitor_interval": config.monitor_interval, "local_addr": config.local_addr,
            "cmd_args": cmd_args}


def _pod_labels(job: dict[str, Any], replica_type: str, index: int) -> dict[str, str]:
    """A PyTorchJob pod's labels: its template's and those the operator adds."""
    template = job["spec"]["pytorchReplicaSpecs"][replica_type]["template"]
    return {**template["metadata"]["labels"], REPLICA_TYPE_LABEL: replica_type.lower(),
            REPLICA_INDEX_LABEL: str(index),
            "training.kubeflow.org/job-name": job["metadata"]["name"]}


def test_kubeflow_lint_strict_passes() -> None:
    result = lint_chart(KUBEFLOW)
    assert result.ok, result.errors


def test_kubeflow_pytorchjob_replaces_the_job_and_headless_service(
    kubeflow_objects: list[dict[str, Any]], ranks_objects: list[dict[str, Any]],
) -> None:
    assert not find(kubeflow_objects, "Job")
    assert not find(kubeflow_objects, "Service", RANKS_SERVICE)  # the operator makes its own
    job = one(kubeflow_objects, "PyTorchJob", TRAINER)
    assert job["apiVersion"] == "kubeflow.org/v1"
    spec = job["spec"]
    assert spec["nprocPerNode"] == "4"
    assert spec["elasticPolicy"] == {
        "rdzvBackend": "c10d", "rdzvHost": f"{TRAINER}-master-0", "rdzvPort": 29400,
        "rdzvId": RELEASE, "rdzvConf": [{"key": "join_timeout", "value": "900"}],
        "minReplicas": 2, "maxReplicas": 2, "maxRestarts": 3}
    assert spec["runPolicy"] == {"backoffLimit": 4, "cleanPodPolicy": "Running"}
    replicas = spec["pytorchReplicaSpecs"]
    assert {t: (r["replicas"], r["restartPolicy"]) for t, r in replicas.items()} == {
        "Master": (1, "OnFailure"), "Worker": (1, "OnFailure")}

    # The pod template is the Indexed Job's, but for what the operator does itself: the
    # container name it requires, the rendezvous (from its PET_* variables instead of flags),
    # its port name, the restart policy (per replica), the pods' DNS names (its Services).
    job_pod = yaml.safe_load(yaml.safe_dump(one(ranks_objects, "Job", TRAINER)["spec"][
        "template"]))
    del job_pod["spec"]["restartPolicy"], job_pod["spec"]["subdomain"]
    for key in ("name", "command", "ports"):
        del job_pod["spec"]["containers"][0][key]
    for replica in replicas.values():
        pod = yaml.safe_load(yaml.safe_dump(replica["template"]))
        main = pod["spec"]["containers"][0]
        assert main.pop("name") == "pytorch"
        assert main.pop("command") == ["python", "-m", "torch.distributed.run", "-m",
                                       "ance_train.cli"]
        assert {p["name"]: p["containerPort"] for p in main.pop("ports")} == {
            "grpc": 50051, "metrics": 9100, "pytorchjob-port": 29400}
        assert pod == job_pod
    master = replicas["Master"]["template"]["spec"]
    assert [c["name"] for c in master["initContainers"]] == ["wait-for-data", "prepare"]
    env = env_of(master["containers"][0])
    assert env["NCCL_SOCKET_IFNAME"]["value"] == "eth0" and set(env) >= CONTRACT_ENV
    assert master["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert {m["mountPath"]: m["name"] for m in master["containers"][0]["volumeMounts"]}[
        "/dev/shm"] == "dshm"
    config = parse_config(yaml.safe_load(
        one(kubeflow_objects, "ConfigMap", f"{FULLNAME}-config")["data"]["config.yaml"]))
    assert config.training.processes == 8
    _validate_all(kubeflow_objects)


def test_kubeflow_services_and_network_policy_select_the_operator_pods(
    kubeflow_objects: list[dict[str, Any]],
) -> None:
    """The trainer's Service reaches only the Master pod (global rank 0); the NetworkPolicies
    let the trainer pods talk to each other and to Redis / the store as the Job's pods do."""
    job = one(kubeflow_objects, "PyTorchJob", TRAINER)
    master, worker = _pod_labels(job, "Master", 0), _pod_labels(job, "Worker", 0)
    service = one(kubeflow_objects, "Service", TRAINER)["spec"]["selector"]
    assert service[REPLICA_TYPE_LABEL] == "master"
    assert selects({"matchLabels": service}, master)
    assert not selects({"matchLabels": service}, worker)
    ranks = one(kubeflow_objects, "NetworkPolicy", f"{FULLNAME}-trainer-ranks")["spec"]
    services = one(kubeflow_objects, "NetworkPolicy", f"{FULLNAME}-services")["spec"]
    for labels in (master, worker):
        assert selects(ranks["podSelector"], labels)
        assert selects(ranks["ingress"][0]["from"][0]["podSelector"], labels)
        assert selects(services["podSelector"], labels)


def test_kubeflow_one_node_is_one_worker_with_probes() -> None:
    """The operator requires a Worker replica with elasticPolicy: one node is one Worker pod,
    the rendezvous host, which holds rank 0 and keeps its gRPC probes."""
    objects = render_chart({"trainer": {"kubeflow": {"enabled": True}, "procsPerNode": 2,
                                        "gpus": 2, "rdzvJoinTimeout": 120}})
    job = one(objects, "PyTorchJob", TRAINER)
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert {t: r["replicas"] for t, r in replicas.items()} == {"Worker": 1}
    elastic = job["spec"]["elasticPolicy"]
    assert elastic["rdzvHost"] == f"{TRAINER}-worker-0"
    assert (elastic["minReplicas"], elastic["maxReplicas"]) == (1, 1)
    assert elastic["rdzvConf"] == [{"key": "join_timeout", "value": "120"}]
    main = _pytorch_container(job, "Worker")
    assert main["readinessProbe"]["grpc"] == {"port": 50051}
    service = one(objects, "Service", TRAINER)["spec"]["selector"]
    assert REPLICA_TYPE_LABEL not in service
    assert selects({"matchLabels": service}, _pod_labels(job, "Worker", 0))
    _validate_all(objects)


@pytest.mark.parametrize(
    ("trainer", "expected"),
    [
        ({"backoffLimit": 0}, {"backoffLimit": 0, "cleanPodPolicy": "Running"}),
        ({"backoffLimit": 7, "activeDeadlineSeconds": 259200, "ttlSecondsAfterFinished": 0,
          "kubeflow": {"enabled": True, "cleanPodPolicy": "None"}},
         {"backoffLimit": 7, "activeDeadlineSeconds": 259200, "ttlSecondsAfterFinished": 0,
          "cleanPodPolicy": "None"}),
    ],
    ids=["no-retry", "all-set"],
)
def test_kubeflow_run_policy_from_values(trainer: dict[str, Any], expected: dict[str, Any]) -> None:
    values = {"trainer": {"nodes": 3, "gpus": 0, "kubeflow": {"enabled": True}, **trainer}}
    job = one(render_chart(values), "PyTorchJob", TRAINER)
    assert job["spec"]["runPolicy"] == expected
    assert {t: r["replicas"] for t, r in job["spec"]["pytorchReplicaSpecs"].items()} == {
        "Master": 1, "Worker": 2}
    _validate_pytorchjob(job)


@pytest.mark.parametrize(
    ("breakage", "how"),
    [
        (lambda job: job["spec"].__setitem__("nprocPerNode", 4), "schema"),  # a string there
        (lambda job: job["spec"]["pytorchReplicaSpecs"]["Worker"].__setitem__(
            "replicas", "one"), "schema"),
        (lambda job: job["spec"].pop("pytorchReplicaSpecs"), "schema"),  # required
        (lambda job: job["spec"]["elasticPolicy"].__setitem__(
            "rdzvBackened", "c10d"), "pruned"),  # misspelt: an API server would drop it
        (lambda job: job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
            "containers"][0].__setitem__("readinesProbe", {}), "pod"),
    ],
    ids=["nproc-int", "replicas-string", "no-replicas", "misspelt-field", "pod-field"],
)
def test_invalid_pytorchjob_is_rejected(
    kubeflow_objects: list[dict[str, Any]], breakage: Any, how: str,
) -> None:
    """The PyTorchJob validation has teeth: each breakage fails it, where expected."""
    job = one(kubeflow_objects, "PyTorchJob", TRAINER)
    _validate_pytorchjob(job)
    broken = yaml.safe_load(yaml.safe_dump(job))
    breakage(broken)
    schema = _pytorchjob_schema()
    assert jsonschema.Draft7Validator(schema).is_valid(broken) == (how != "schema")
    # The CRD embeds the pod schema: a misspelt pod field would be pruned as well.
    assert bool(_undeclared(broken, schema)) == (how in ("pruned", "pod"))
    if how == "pod":
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(
                {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "master"},
                 "template": broken["spec"]["pytorchReplicaSpecs"]["Master"]["template"]},
                KUBE_VERSION, strict=True)
    with pytest.raises((jsonschema.ValidationError, AssertionError,
                        kubernetes_validate.ValidationError)):
        _validate_pytorchjob(broken)


@pytest.mark.parametrize(
    "trainer",
    [{}, RANKS["trainer"]],
    ids=["one-process", "ranks"],
)
def test_trainer_pod_is_written_once(trainer: dict[str, Any]) -> None:
    """The Job's pod and the PyTorchJob's (its rank-0 replica: Master, or the one Worker) come
    from one named template (_trainer-pod.tpl): their init containers, the trainer
    container's image, arguments, environment, mounts, probes, resources and security
    context, the volumes, the scheduling and the pod's metadata agree; only what the
    operator does itself differs (the container's name, torchrun's rendezvous flags, the
    rendezvous port's name, the restart policy, the headless Service's subdomain)."""
    scheduling = {"nodeSelector": {"pool": "train"}, "tolerations": [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "gpu", "operator": "In", "values": ["a100"]}]}]}}}}
    values = {"trainer": {**trainer, **scheduling}}
    job = one(render_chart(values), "Job", TRAINER)
    pytorchjob = one(render_chart({"trainer": {**values["trainer"], "kubeflow": {
        "enabled": True}}}), "PyTorchJob", TRAINER)
    replicas = pytorchjob["spec"]["pytorchReplicaSpecs"]
    rank0 = replicas["Master" if "Master" in replicas else "Worker"]["template"]
    job_pod, operator_pod = job["spec"]["template"], rank0
    assert job_pod["metadata"] == operator_pod["metadata"]
    job_spec, operator_spec = job_pod["spec"], operator_pod["spec"]
    assert job_spec.pop("restartPolicy") == "Never" and "restartPolicy" not in operator_spec
    job_spec.pop("subdomain", None)
    job_main, operator_main = job_spec.pop("containers")[0], operator_spec.pop("containers")[0]
    assert job_spec == operator_spec  # init containers, volumes, scheduling, accounts...
    assert job_spec["nodeSelector"] == {"pool": "train"}
    assert job_spec["affinity"] == scheduling["affinity"]
    assert (job_main.pop("name"), operator_main.pop("name")) == ("trainer", "pytorch")
    assert operator_main.pop("command") == ["python", "-m", "torch.distributed.run", "-m",
                                            "ance_train.cli"]
    job_command = job_main.pop("command", None)
    assert (job_command is None) == (not trainer)  # one process: the image's entrypoint
    rendezvous_ports = {"rdzv", "pytorchjob-port"}
    assert ([p for p in job_main.pop("ports") if p["name"] not in rendezvous_ports]
            == [p for p in operator_main.pop("ports") if p["name"] not in rendezvous_ports])
    if not trainer:  # the operator's pods always run torchrun: RANKS_ENV
        operator_main["env"] = [e for e in operator_main["env"] if e["name"] not in RANKS_ENV]
    assert job_main == operator_main
    for template in ("trainer.yaml", "trainer-pytorchjob.yaml"):
        source = (CHART_DIR / "templates" / template).read_text()
        assert 'include "ance-train.trainerPod"' in source, template
        assert not re.search(r"^\s*(containers|initContainers|volumes):", source, re.M), template


def test_pytorchjob_crd_fixture_names_its_source() -> None:
    header = PYTORCHJOB_CRD.read_text().split("\n---\n", 1)[0]
    for text in ("github.com/kubeflow/training-operator",
                 "manifests/base/crds/kubeflow.org_pytorchjobs.yaml", "v1.9.0",
                 "6f74c7f6b2ed6c27aabd82d0a316b23f0646059c", "Apache License 2.0"):
        assert text in header, text


def test_rank_commands_launch_the_same_as_the_embedded_launcher(
    ranks_objects: list[dict[str, Any]], kubeflow_objects: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """The embedded launcher, the Indexed Job's pods and the PyTorchJob's pods (with the
    variables the operator adds) launch the same rank code with the same settings, as
    torchrun itself reads their commands; only where the c10d rendezvous is differs
    (127.0.0.1 embedded, pod 0 / the Master pod in the cluster) and how many nodes meet."""
    embedded_argv = ["python", *service_command("trainer", 4).argv[1:], "serve", "trainer"]
    embedded = _launch(embedded_argv, {}, monkeypatch, tmp_path)

    job_main = pod_spec(one(ranks_objects, "Job", TRAINER))["containers"][0]
    job_pods = [_launch([arg.replace("$(JOB_COMPLETION_INDEX)", str(index)) for arg in
                         [*job_main["command"], *job_main["args"]]], {}, monkeypatch, tmp_path)
                for index in (0, 1)]

    pytorchjob = one(kubeflow_objects, "PyTorchJob", TRAINER)
    operator_pods = []
    for replica_type in ("Master", "Worker"):
        main = _pytorch_container(pytorchjob, replica_type)
        env = {**{e["name"]: e["value"] for e in main["env"] if "value" in e},
               **operator_env(pytorchjob, replica_type, 0)}
        operator_pods.append(_launch([*main["command"], *main["args"]], env, monkeypatch,
                                     tmp_path))

    rank_code = ["-u", "-m", "ance_train.cli", "serve", "trainer"]
    for launch in (embedded, *job_pods, *operator_pods):
        assert launch["cmd_args"] == rank_code
        assert launch["nproc_per_node"] == 4
        for key in ("role", "start_method", "monitor_interval", "local_addr"):
            assert launch[key] == embedded[key], key
    assert (embedded["nodes"], embedded["rdzv_backend"], embedded["max_restarts"]) == (
        (1, 1), "c10d", 3)
    cluster = {"nodes": (2, 2), "rdzv_backend": "c10d", "run_id": RELEASE, "max_restarts": 3}
    for launch in (*job_pods, *operator_pods):
        assert {k: launch[k] for k in cluster} == cluster
        assert launch["rdzv_configs"]["join_timeout"] == "900"
    assert job_pods[0] == job_pods[1]
    assert operator_pods[0] == operator_pods[1]
    assert job_pods[0]["rdzv_endpoint"] == f"{TRAINER}-0.{RANKS_SERVICE}:29400"
    assert operator_pods[0]["rdzv_endpoint"] == f"{TRAINER}-master-0:29400"
    # Apart from where the rendezvous is, the Job's and the PyTorchJob's pods launch alike.
    assert ({**job_pods[0], "rdzv_endpoint": None}
            == {**operator_pods[0], "rdzv_endpoint": None})


@pytest.mark.parametrize(
    ("trainer", "field"),
    [
        ({"kubeflow": {"enabled": "yes"}}, "/trainer/kubeflow/enabled"),
        ({"kubeflow": {"enabled": True, "cleanPodPolicy": "Finished"}},
         "/trainer/kubeflow/cleanPodPolicy"),
        ({"kubeflow": {"enabled": True, "elastic": True}}, "elastic"),
        ({"rdzvJoinTimeout": 0}, "/trainer/rdzvJoinTimeout"),
        ({"rdzvJoinTimeout": "15m"}, "/trainer/rdzvJoinTimeout"),
    ],
)
def test_values_schema_rejects_bad_kubeflow_values(trainer: dict[str, Any], field: str) -> None:
    with pytest.raises(HelmError) as failure:
        render_manifests({"trainer": trainer})
    message = str(failure.value)
    assert "schema" in message or "at '" in message, message
    assert field in message, message


def test_notes_name_the_pytorchjob_and_the_world_size() -> None:
    notes = render_notes(KUBEFLOW)
    assert "trainer ×8 ranks (2 pod(s) × 4; a Kubeflow PyTorchJob" in notes
    assert f"get pytorchjob {TRAINER} -w" in notes
    assert f"logs -f {TRAINER}-master-0" in notes
    assert "get job " not in notes and "job/" not in notes
    indexed = render_notes(RANKS)
    assert "trainer ×8 ranks (2 pod(s) × 4; an Indexed Job" in indexed
    assert "batch.kubernetes.io/job-completion-index=0" in indexed


# --------------------------------------------------------------------------- images


def _dockerfile(name: str) -> DockerfileParser:
    """A parser over an in-memory copy (a path-based parser may write the file back)."""
    return DockerfileParser(fileobj=io.BytesIO((REPO_ROOT / "docker" / name).read_bytes()))


@pytest.mark.parametrize(
    ("name", "base", "faiss"),
    [("Dockerfile", "nvidia/cuda:", "faiss-gpu=="), ("Dockerfile.cpu", "python:3.11-slim", "")],
)
def test_dockerfile(name: str, base: str, faiss: str) -> None:
    parser = _dockerfile(name)
    structure = [(i["instruction"], i["value"]) for i in parser.structure
                 if i["instruction"] != "COMMENT"]
    # dockerfile-parse leaves the ARG-based FROM unexpanded: read the ARG's default.
    (from_value,) = [v for k, v in structure if k == "FROM"]
    arg_name = from_value.strip("${}")
    base_image = re.search(rf"^{arg_name}=(\S+)$", "\n".join(
        v for k, v in structure if k == "ARG"), re.M)
    assert base_image, from_value
    assert base_image.group(1).startswith(base)
    if base.startswith("nvidia/cuda"):
        assert "runtime" in base_image.group(1)
        assert "python3.11" in parser.content

    users = [v for k, v in structure if k == "USER"]
    assert users, "no USER: the image would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, users[-1]
    instructions = [k for k, _ in structure]
    assert instructions.index("USER") > max(i for i, k in enumerate(instructions) if k == "RUN")
    assert dict(structure)["ENTRYPOINT"] == '["ance-train"]'
    assert dict(structure)["WORKDIR"]

    secretish = re.compile(r"PASSWORD|SECRET|TOKEN|ACCESS_KEY|CREDENTIAL|API_KEY", re.I)
    assert not [k for k in {**parser.envs, **parser.args} if secretish.search(k)]
    assert not [v for v in parser.envs.values() if secretish.search(v)]

    runs = [v for k, v in structure if k == "RUN"]
    install = next(r for r in runs if 'pip install ".[k8s]"' in r)
    if faiss:  # the GPU FAISS replaces faiss-cpu after the package's own requirements
        order = [install.index(s) for s in ('pip install ".[k8s]"', "uninstall -y faiss-cpu",
                                            "$FAISS_GPU_SPEC")]
        assert order == sorted(order)
        assert parser.args["FAISS_GPU_SPEC"].startswith(faiss)
    else:  # faiss-cpu comes with the package's own requirements
        assert "faiss-gpu" not in parser.content and "uninstall" not in parser.content
    for source in (v.split()[:-1] for k, v in structure if k == "COPY"):
        for path in source:
            assert (REPO_ROOT / path).exists(), path


def test_dockerignore_keeps_the_context_to_the_package() -> None:
    lines = [line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[0] == "*"  # everything excluded, then the package sources allowed back
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", "src"}
    copied = {path.rstrip("/") for name in ("Dockerfile", "Dockerfile.cpu")
              for k, v in ((i["instruction"], i["value"]) for i in _dockerfile(name).structure)
              if k == "COPY" for path in v.split()[:-1]}
    assert copied <= allowed


def test_an_engine_without_an_api_server_can_turn_the_ancerun_off() -> None:
    """anceRun.enabled false (helm/examples/values-local.yaml, for podman kube play): no AnceRun
    object, no ANCE_ANCERUN in any container (the services would otherwise refuse to start
    without an API server), and NOTES do not send the operator to `kubectl get anceruns`."""
    on = render_chart({})
    assert find(on, "AnceRun")
    assert all("ANCE_ANCERUN" in env_of(c) for w in all_workloads(on)
               for c in containers(w) if c["name"] not in ("redis", "minio"))
    off = render_chart({"anceRun": {"enabled": False}})
    assert not find(off, "AnceRun")
    ance = [c for w in all_workloads(off) for c in containers(w)
            if c["name"] not in ("redis", "minio")]
    assert ance and all("ANCE_ANCERUN" not in env_of(c) for c in ance)
    notes = render_notes({"anceRun": {"enabled": False}})
    assert "get anceruns" not in notes and "ance-train status" in notes
    assert "get anceruns" in render_notes({})


def test_only_the_prepare_step_reaches_the_hub() -> None:
    """model.path may be a Hub id: the trainer's init step `prepare` downloads it once into
    the run's store (docs/models.md), so only that container is online (the image is offline),
    keeps the Hub cache on the work volume and gets the token of hub.tokenSecret; every other
    container stays offline and never sees the token."""
    values = {"run": {"config": {"model": {"path": "BAAI/bge-small-en-v1.5"}}},
              "hub": {"tokenSecret": "hf-token", "endpoint": "https://hub.mirror.internal"}}
    objects = render_chart(values)
    job = one(objects, "Job", "ance-train-trainer")
    prepare = next(c for c in pod_spec(job)["initContainers"] if c["name"] == "prepare")
    env = env_of(prepare)
    assert env["HF_HUB_OFFLINE"]["value"] == "0" and env["TRANSFORMERS_OFFLINE"]["value"] == "0"
    assert env["HF_HOME"]["value"].startswith("/work/")
    assert env["HF_ENDPOINT"]["value"] == "https://hub.mirror.internal"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    for workload in all_workloads(objects):
        for container in containers(workload):
            if container is prepare or container["name"] == "prepare":
                continue
            assert "HF_TOKEN" not in env_of(container), container["name"]
            assert env_of(container).get("HF_HUB_OFFLINE", {}).get("value") != "0"
    default = next(c for c in pod_spec(one(render_chart({}), "Job", "ance-train-trainer"))
                   ["initContainers"] if c["name"] == "prepare")
    assert "HF_TOKEN" not in env_of(default)
