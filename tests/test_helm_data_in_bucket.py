"""The chart with the dataset in a bucket: with ``data.existingClaim`` empty and
``run.config.data.path: s3://bucket/prefix/`` no ance pod mounts a data volume; an empty claim
with a local path fails the render naming both values. Rendered and linted by real Helm
(``helm_render``)."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from ance_train.config import parse_config

from ance_train_dev.helm_render import (
    KUBE_VERSION,
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

IN_BUCKET = {"data": {"existingClaim": ""},
             "run": {"config": {"data": {"format": "beir",
                                         "path": "s3://ml-datasets/beir/scifact/"}}}}
WORKLOADS = {"trainer": "Job", "inferencer": "Deployment", "indexer": "Deployment"}


def test_dataset_in_a_bucket_mounts_no_data_volume() -> None:
    objects = render_chart(IN_BUCKET)
    config = parse_config(yaml.safe_load(
        one(objects, "ConfigMap", "ance-train-config")["data"]["config.yaml"]))
    assert config.data.path == "s3://ml-datasets/beir/scifact/"
    for role, kind in WORKLOADS.items():
        spec = pod_spec(one(objects, kind, f"ance-train-{role}"))
        names = {v["name"] for v in spec["volumes"]}
        assert "data" not in names and {"config", "work", "tmp"} <= names, role
        every = containers(one(objects, kind, f"ance-train-{role}")) + \
            spec.get("initContainers", [])
        for container in every:
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert "/data" not in mounts and "/etc/ance" in mounts, (role, container["name"])
            env = {e["name"] for e in container.get("env", [])}
            # The bucket is read with the store's endpoint and keys.
            assert {"ANCE_S3_ENDPOINT", "ANCE_S3_ACCESS_KEY", "ANCE_S3_SECRET_KEY"} <= env
    for workload in (o for kind in ("Job", "Deployment") for o in find(objects, kind)):
        kubernetes_validate.validate(workload, KUBE_VERSION, strict=True)
    result = lint_chart(IN_BUCKET)
    assert result.ok, result.errors
    assert "in the bucket\n(s3://ml-datasets/beir/scifact/)" in render_notes(IN_BUCKET)


ON_A_VOLUME = {"data": {"existingClaim": "ance-data"},
               "run": {"config": {"data": {"path": "/data/scifact"}}}}


def test_the_default_reads_the_bucket_and_needs_no_volume() -> None:
    """A plain install creates nothing to wait for: no pod mounts a claim that must exist
    first (the old default, data.existingClaim: ance-data, left every pod Pending)."""
    objects = render_chart({})
    config = parse_config(yaml.safe_load(
        one(objects, "ConfigMap", "ance-train-config")["data"]["config.yaml"]))
    assert config.data.path.startswith("s3://")
    for kind in ("Job", "Deployment", "StatefulSet"):
        for workload in find(objects, kind):
            assert not [v for v in pod_spec(workload).get("volumes", [])
                        if "persistentVolumeClaim" in v], workload["metadata"]["name"]


def test_a_claim_is_still_mounted_when_named() -> None:
    objects = render_chart(ON_A_VOLUME)
    for role, kind in WORKLOADS.items():
        spec = pod_spec(one(objects, kind, f"ance-train-{role}"))
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "ance-data",
                                                            "readOnly": True}, role
    # Nothing to wait for on a volume: prepare validates it at once.
    assert [c["name"] for c in containers(one(objects, "Job", "ance-train-trainer"))] == [
        "prepare", "trainer"]


def test_no_claim_and_a_local_path_fails_the_render() -> None:
    with pytest.raises(HelmError) as failure:
        render_manifests({"run": {"config": {"data": {"path": "/data/scifact"}}}})
    message = str(failure.value)
    assert "data.existingClaim is empty" in message and "/data/scifact" in message, message
    assert "s3://bucket/prefix/" in message
