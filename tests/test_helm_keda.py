"""KEDA scaling of the inferencers (inferencer.keda.enabled) and a Deployment without
spec.replicas (KEDA's, or inferencer.replicas: null), so that `helm upgrade` leaves the count
that KEDA or `kubectl scale` set. The ScaledObject and its TriggerAuthentication are rendered
by real Helm and validated against KEDA's CRDs (release v2.20.1, kept under
tests/fixtures/crds/ with their source and licence), as the PyTorchJob is against the
training operator's; the stream and consumer group they watch are those the services use."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from test_helm_chart import KEDA_CRDS, _keda_schema, _undeclared, _validate_all, _validate_keda

from ance_train.infra.bus import EventBus, WorkQueue
from ance_train.protocol.work import ShardWork

from ance_train_dev.helm_render import (
    HelmError,
    find,
    lint_chart,
    one,
    render_chart,
    render_manifests,
    render_notes,
)

FULLNAME = "ance-train"
INFERENCER = f"{FULLNAME}-inferencer"
KEDA = {"inferencer": {"keda": {"enabled": True, "minReplicas": 2, "maxReplicas": 32,
                                "lagCount": 3}}}


@pytest.fixture(scope="module")
def keda_objects() -> list[dict[str, Any]]:
    return render_chart(KEDA)


def _trigger(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (trigger,) = one(objects, "ScaledObject", INFERENCER)["spec"]["triggers"]
    return trigger


def test_keda_is_off_by_default() -> None:
    objects = render_chart()
    assert not find(objects, "ScaledObject") + find(objects, "TriggerAuthentication")
    assert one(objects, "Deployment", INFERENCER)["spec"]["replicas"] == 2


def test_scaled_object_watches_the_inferencers_work_queue(
    keda_objects: list[dict[str, Any]],
) -> None:
    assert lint_chart(KEDA).ok
    _validate_all(keda_objects)
    scaled = one(keda_objects, "ScaledObject", INFERENCER)
    spec = scaled["spec"]
    deployment = one(keda_objects, "Deployment", INFERENCER)
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                      "name": deployment["metadata"]["name"]}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 32)
    trigger = _trigger(keda_objects)
    assert trigger["type"] == "redis-streams"
    meta = trigger["metadata"]
    # The stream and the consumer group the inferencers read their shards through.
    queue = WorkQueue(EventBus(client=None, run_id="ance-run"), claim_timeout_s=120)
    assert meta["stream"] == queue.stream == f"ance:ance-run:{ShardWork.TYPE}"
    assert meta["consumerGroup"] == WorkQueue.GROUP
    # The backlog (entries not yet delivered to the group), not the in-flight count.
    assert meta["lagCount"] == "3" and "pendingEntriesCount" not in meta
    # KEDA's metadata values are strings (the CRD's map[string]string).
    assert all(isinstance(v, str) for v in meta.values())
    # The Redis the pods use: same address, database, no TLS here.
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["ANCE_REDIS_URL"]["value"] == f"redis://{meta['address']}/{meta['databaseIndex']}"
    assert meta["enableTLS"] == "false"
    auth = one(keda_objects, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    assert auth["spec"]["secretTargetRef"] == [{
        "parameter": "password", **env["ANCE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]}]
    # KEDA's operator may reach the release's Redis through its NetworkPolicy.
    ingress = one(keda_objects, "NetworkPolicy", f"{FULLNAME}-redis")["spec"]["ingress"]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "keda-operator"}}} in [
        peer for rule in ingress for peer in rule["from"]]


def test_keda_uses_the_pods_external_redis_and_tls() -> None:
    values = {**KEDA, "redis": {"enabled": False},
              "externalRedis": {"host": "redis.data.svc", "port": 6380, "db": 3},
              "auth": {"existingSecret": "ext-credentials",
                       "secretKeys": {"redisPassword": "pw", "s3AccessKey": "ak",
                                      "s3SecretKey": "sk"}},
              "tls": {"redis": {"enabled": True, "secretName": "redis-ca",
                                "clientSecretName": "redis-client"}}}
    objects = render_chart(values)
    _validate_all(objects)
    meta = _trigger(objects)["metadata"]
    assert (meta["address"], meta["databaseIndex"], meta["enableTLS"]) == (
        "redis.data.svc:6380", "3", "true")
    refs = {r["parameter"]: (r["name"], r["key"]) for r in one(
        objects, "TriggerAuthentication", f"{INFERENCER}-redis")["spec"]["secretTargetRef"]}
    assert refs == {"password": ("ext-credentials", "pw"), "ca": ("redis-ca", "ca.crt"),
                    "cert": ("redis-client", "tls.crt"), "key": ("redis-client", "tls.key")}


@pytest.mark.parametrize(
    "values",
    [KEDA, {"inferencer": {"replicas": None}}],
    ids=["keda", "replicas-null"],
)
def test_deployment_leaves_replicas_to_the_scaler(values: dict[str, Any]) -> None:
    """No spec.replicas: an upgrade then never resets what KEDA or `kubectl scale` set; the
    pod template is the same as with a fixed count, so switching restarts nothing."""
    objects = render_chart(values)
    deployment = one(objects, "Deployment", INFERENCER)
    assert "replicas" not in deployment["spec"]
    fixed = one(render_chart(), "Deployment", INFERENCER)
    assert deployment["spec"]["template"] == fixed["spec"]["template"]
    _validate_all(objects)
    notes = render_notes(values)
    assert "resets it to inferencer.replicas" not in notes
    assert f"scaledobject {INFERENCER}" in notes if values is KEDA else (
        "`helm upgrade` keeps the count" in notes)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"inferencer": {"keda": {"enabled": True}}, "auth": {"redisUsername": "ance"}},
         "XINFO GROUPS"),
        ({"inferencer": {"keda": {"enabled": True, "minReplicas": 9, "maxReplicas": 4}}},
         "maxReplicas (4) is below inferencer.keda.minReplicas (9)"),
        ({"inferencer": {"keda": {"enabled": True, "lagCount": 0}}},
         "/inferencer/keda/lagCount"),
        ({"inferencer": {"keda": {"enabled": True, "scaler": "cpu"}}}, "scaler"),
        ({"inferencer": {"replicas": "four"}}, "/inferencer/replicas"),
    ],
    ids=["acl-user", "max-below-min", "zero-lag", "unknown-key", "replicas-string"],
)
def test_bad_keda_values_fail_the_render(values: dict[str, Any], expected: str) -> None:
    with pytest.raises(HelmError) as failure:
        render_manifests(values)
    assert expected in str(failure.value), str(failure.value)


@pytest.mark.parametrize(
    ("breakage", "kind"),
    [
        (lambda o: o["spec"].__setitem__("minReplicaCount", "2"), "ScaledObject"),
        (lambda o: o["spec"]["triggers"][0]["metadata"].__setitem__("lagCount", 3),
         "ScaledObject"),
        (lambda o: o["spec"].pop("scaleTargetRef"), "ScaledObject"),
        (lambda o: o["spec"].__setitem__("maxReplicas", 8), "ScaledObject"),  # pruned
        (lambda o: o["spec"]["secretTargetRef"][0].pop("key"), "TriggerAuthentication"),
    ],
    ids=["min-string", "metadata-int", "no-target", "misspelt-field", "ref-without-key"],
)
def test_invalid_keda_objects_are_rejected(
    keda_objects: list[dict[str, Any]], breakage: Any, kind: str,
) -> None:
    """The validation against KEDA's CRDs has teeth."""
    import copy

    obj = copy.deepcopy(one(keda_objects, kind, INFERENCER if kind == "ScaledObject"
                            else f"{INFERENCER}-redis"))
    _validate_keda(obj)
    breakage(obj)
    schema = _keda_schema(kind)
    assert not (jsonschema.Draft7Validator(schema).is_valid(obj) and not _undeclared(obj, schema))
    with pytest.raises((jsonschema.ValidationError, AssertionError)):
        _validate_keda(obj)


def test_keda_crd_fixtures_name_their_source() -> None:
    for kind, path in KEDA_CRDS.items():
        header = path.read_text().split("\n---\n", 1)[0]
        for text in ("github.com/kedacore/keda", f"config/crd/bases/{path.name}", "v2.20.1",
                     "875675ce5cd1d34772fe00a228a71b8bf05b3b43", "Apache License 2.0",
                     "Apache-2.0"):
            assert text in header, (kind, text)
