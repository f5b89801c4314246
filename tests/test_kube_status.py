"""The services in cluster mode report a run's progress on its AnceRun, as Kubernetes Events and
as Prometheus metrics.

Trainer, one inferencer and the indexer run as OS processes with the cluster's settings:
``ANCE_CLUSTER_MODE=1``, a real redis-server with ``requirepass``, a real S3 server (moto,
through the minio client), started before ``ance-train prepare`` publishes the dataset index.
The Kubernetes API is the one stand-in (dev/ance_train_dev/kube_standin.py: no API server can
run here); the services reach it through the official ``kubernetes`` client, and it holds the
AnceRun, CRD and Role that the Helm chart renders. Midway through training the stand-in goes
down for a few seconds. Metrics are scraped from the live services over HTTP.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ance_train.infra.bus import EventBus, connect
from ance_train.launcher.embedded import service_command
from ance_train.launcher.redis_server import RedisServer
from ance_train.observability.kube import KubeSettings, RunReporter
from ance_train.protocol import keys
from ance_train.protocol.events import EvalCompleted
from ance_train.runtime import ranks_restart_on_failure

from ance_train_dev.helm_render import NAMESPACE, find, one, render_chart
from ance_train_dev.helpers import write_config
from ance_train_dev.kube_standin import ApiRequest, KubeStandIn, role_allows
from ance_train_dev.servers import free_port
from ance_train_dev.service_harness import Harness, stop, wait_until

pytestmark = pytest.mark.e2e

REDIS_PASSWORD = "redis-pw-kube-81c3f2"
S3_SECRET = "s3-secret-kube-55e0d7"
STEPS = 60
REFRESH_EVERY = 20
DOWN_S = 4.0
SERVICES = ("indexer", "inferencer", "trainer")
Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Scrape | None:
    """``/metrics`` of a service as {(sample name, labels): value}; None if it is not up."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(sample: Scrape, name: str, **labels: str) -> float:
    return sample[(name, tuple(sorted(labels.items())))]


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory, s3_env, tiny_model, scifact_subset) -> dict:
    root = tmp_path_factory.mktemp("kube-status")
    chart = render_chart()
    ancerun = find(chart, "AnceRun")[0]
    standin = KubeStandIn(ancerun, NAMESPACE, one(chart, "CustomResourceDefinition",
                                                  "anceruns.ance-train.io")).start()
    redis = RedisServer(root / "redis", password=REDIS_PASSWORD).start()
    config_path = write_config(
        root / "config.yaml", run_id="kube-status",
        data={"path": str(scifact_subset), "dev_fraction": 0.2},
        model={"path": str(tiny_model), "max_query_length": 32, "max_doc_length": 96},
        training={"steps": STEPS, "batch_size": 8, "refresh_every": REFRESH_EVERY,
                  "warmup_steps": 5, "learning_rate": 1e-4, "torch_threads": 1},
        negatives={"pool": "ann", "per_query": 2, "warmup": "none", "top_k": 30},
        inference={"shard_size": 100, "query_shard_size": 80, "batch_size": 32,
                   "claim_timeout_s": 10, "torch_threads": 1},
        index={"eval_depth": 100})
    harness = Harness(root, config_path, f"redis://127.0.0.1:{redis.port}/0",
                      {**s3_env, "ANCE_S3_SECRET_KEY": S3_SECRET})
    ports = {role: free_port() for role in SERVICES}
    cluster_env = {"ANCE_CLUSTER_MODE": "1", "ANCE_REDIS_PASSWORD": REDIS_PASSWORD,
                   "ANCE_ANCERUN": ancerun["metadata"]["name"], "ANCE_K8S_NAMESPACE": NAMESPACE,
                   "ANCE_KUBE_API": standin.url, "ANCE_DATASET_TIMEOUT_S": "300"}
    processes: dict[str, subprocess.Popen] = {}
    scrapes: dict[str, Scrape] = {}
    started = time.monotonic()
    try:
        for role in SERVICES:  # as pods do: all at once, before the dataset index exists
            processes[role] = harness.spawn(role, role, {**cluster_env,
                                                         "ANCE_METRICS_PORT": str(ports[role])})
        for role in SERVICES:
            wait_until(lambda r=role: "waiting for the dataset index" in harness.log(r)
                       or processes[r].poll() is not None, 120, f"{role} waits for the index")
        prepared = subprocess.run(
            [sys.executable, "-m", "ance_train.cli", "prepare", "--config", str(config_path)],
            capture_output=True, text=True, env={**harness.env(), **cluster_env}, timeout=180)
        assert prepared.returncode == 0, prepared.stderr

        def observe() -> None:
            for role, port in ports.items():
                sample = scrape(port)
                if sample is not None:
                    scrapes[role] = sample
            for role, process in processes.items():
                # In the cluster only the trainer (a Job) ends, and only with success.
                if role == "trainer" and process.poll() == 0:
                    continue
                assert process.poll() is None, harness.log(role)

        def trainer_step() -> float:
            return metric(scrapes["trainer"], "ance_trainer_step") if "trainer" in scrapes else 0

        wait_until(lambda: (observe(), standin.status.get("phase") == "Training")[1], 300,
                   "the AnceRun reports Training", interval_s=0.2)
        observe()
        outage = {"step_before": trainer_step()}
        standin.stop()
        down_until = time.monotonic() + DOWN_S
        while time.monotonic() < down_until:
            observe()
            time.sleep(0.3)
        outage["step_after"] = trainer_step()
        standin.start()

        def finished() -> bool:
            observe()
            status = standin.status
            return (processes["trainer"].poll() == 0
                    and status.get("evalStep") == STEPS and status.get("phase") == "Succeeded")

        wait_until(finished, 480, "trainer finished and final checkpoint evaluated",
                   interval_s=0.5)
        observe()  # the indexer's metrics after its final refresh
        # The trainer is a Job: once finished it exited by itself, with success; the
        # inferencers and the indexer (Deployments) stay up until the release goes.
        trainer_code = processes["trainer"].returncode
        bus = EventBus(connect(harness.redis_url, REDIS_PASSWORD),
                              harness.config.run_id)
        evaluations = [e.step for e in bus.history(EvalCompleted)]
        final_eval = harness.store.get_json(keys.eval_report(STEPS))
    finally:
        for process in processes.values():
            stop(process)
        standin.stop()
        redis.stop()
    return {"standin": standin, "chart": chart, "scrapes": scrapes, "outage": outage,
            "trainer_code": trainer_code, "evaluations": evaluations,
            "final_eval": final_eval, "seconds": time.monotonic() - started,
            "exit_codes": {r: p.returncode for r, p in processes.items()},
            "logs": {r: harness.log(r) for r in SERVICES},
            "prepare_output": prepared.stdout + prepared.stderr}


def test_services_waited_for_the_dataset_and_ended_cleanly(cluster_run: dict) -> None:
    assert cluster_run["trainer_code"] == 0, cluster_run["logs"]["trainer"]
    for role in SERVICES:
        assert cluster_run["logs"][role].count("waiting for the dataset index") == 1
        assert cluster_run["exit_codes"][role] == 0, cluster_run["logs"][role]


def test_ancerun_status_progressed_to_succeeded(cluster_run: dict) -> None:
    standin: KubeStandIn = cluster_run["standin"]
    phases = [s.get("phase") for s in standin.statuses]
    assert "Failed" not in phases
    assert phases.index("Training") < phases.index("Succeeded")
    assert phases[-1] == "Succeeded"
    status = standin.status
    assert status["worldSize"] == 1  # one trainer process
    assert status["step"] == status["totalSteps"] == STEPS
    assert status["latestCheckpoint"] == STEPS
    assert 0 <= status["negativesStep"] <= STEPS
    assert status["negativesStep"] % REFRESH_EVERY == 0  # a checkpoint's negatives
    assert status["asyncGap"] == status["step"] - status["negativesStep"]
    assert status["indexStep"] == status["evalStep"] == STEPS
    assert 0 < status["refreshPeriodSeconds"] < cluster_run["seconds"]
    dev = cluster_run["final_eval"]["metrics"]["dev"]  # the AnceRun shows the dev split
    assert status["ndcgAt10"] == pytest.approx(dev["ndcg@10"])
    assert status["mrrAt10"] == pytest.approx(dev["mrr@10"])
    assert 0 <= status["ndcgAt10"] <= 1 and 0 <= status["mrrAt10"] <= 1
    updated = datetime.fromisoformat(status["updated"].replace("Z", "+00:00"))
    assert abs((datetime.now(UTC) - updated).total_seconds()) < cluster_run["seconds"] + 60
    assert standin.pruned == set() and standin.rejected == []  # fields the CRD declares
    steps = [s["step"] for s in standin.statuses if "step" in s]
    # progress seen on the way (how many intermediate steps depends on speed: sends are
    # throttled to one per 3 s, and the stand-in is down for a while)
    assert steps == sorted(steps) and steps[0] < steps[-1] == STEPS, steps


def test_events_name_the_ancerun_and_none_was_lost(cluster_run: dict) -> None:
    standin: KubeStandIn = cluster_run["standin"]
    run = standin.ancerun["metadata"]
    reasons = [e["reason"] for e in standin.events.values()]
    for event in standin.events.values():
        involved = event["involvedObject"]
        assert (involved["kind"], involved["name"], involved["uid"]) == (
            "AnceRun", run["name"], run["uid"])
        assert involved["apiVersion"] == "ance-train.io/v1alpha1"
        assert event["type"] == "Normal"
        assert event["metadata"]["namespace"] == NAMESPACE
    checkpoints = STEPS // REFRESH_EVERY + 1  # 0, 20, 40, 60
    assert reasons.count("CheckpointPublished") == checkpoints
    assert reasons.count("IndexRefreshed") == len(cluster_run["evaluations"]) >= 2
    assert reasons.count("EvaluationDone") == len(cluster_run["evaluations"])
    assert reasons.count("RunSucceeded") == 1
    assert not {"RunFailed", "ServiceFailed"} & set(reasons)


def test_every_api_request_is_allowed_by_the_chart_role(cluster_run: dict) -> None:
    standin: KubeStandIn = cluster_run["standin"]
    rules = find(cluster_run["chart"], "Role")[0]["rules"]
    made = set(standin.requests)
    assert ApiRequest("patch", "ance-train.io", "anceruns/status", NAMESPACE,
                      standin.name) in made
    assert ApiRequest("create", "", "events", NAMESPACE, "") in made
    refused = [r for r in made if not role_allows(rules, r)]
    assert refused == []


def test_reporting_survived_the_api_server_outage(cluster_run: dict) -> None:
    outage = cluster_run["outage"]
    assert outage["step_after"] > outage["step_before"]  # training went on meanwhile
    trainer_log = cluster_run["logs"]["trainer"]
    assert 1 <= trainer_log.count("cannot report to AnceRun") <= 2  # rate-limited
    assert "reporting works again" in trainer_log


def test_metrics_were_served_with_sensible_values(cluster_run: dict) -> None:
    scrapes = cluster_run["scrapes"]
    trainer, inferencer, indexer = (scrapes[r] for r in ("trainer", "inferencer", "indexer"))
    assert 1 <= metric(trainer, "ance_trainer_step") <= STEPS
    loss = metric(trainer, "ance_trainer_loss")
    assert math.isfinite(loss) and loss > 0
    assert 0 <= metric(trainer, "ance_trainer_negatives_step") <= STEPS
    assert 0 <= metric(trainer, "ance_trainer_async_gap_steps") <= STEPS
    assert metric(trainer, "ance_checkpoints_published_total") >= 1
    assert metric(inferencer, "ance_inferencer_shards_encoded_total") >= 2 * 4  # 3 + 1 / refresh
    assert metric(inferencer, "ance_inferencer_docs_encoded_total") >= 2 * 300
    assert metric(inferencer, "ance_inferencer_docs_per_second") > 0
    assert metric(indexer, "ance_index_step") == STEPS
    dev = cluster_run["final_eval"]["metrics"]["dev"]
    assert metric(indexer, "ance_eval_metric", split="dev", measure="ndcg@10") == (
        pytest.approx(dev["ndcg@10"]))
    refreshes = len(cluster_run["evaluations"])
    assert metric(indexer, "ance_refresh_latency_seconds_count") == refreshes
    assert 0 < metric(indexer, "ance_refresh_latency_seconds_sum") < refreshes * 600
    names = {name for name, _ in trainer}
    assert not any(n.startswith(("ance_inferencer_", "ance_index_")) for n in names)


def test_no_secret_in_any_log(cluster_run: dict) -> None:
    texts = [*cluster_run["logs"].values(), cluster_run["prepare_output"]]
    for text in texts:
        assert REDIS_PASSWORD not in text and S3_SECRET not in text


@pytest.fixture
def standin() -> Iterator[KubeStandIn]:
    chart = render_chart()
    with KubeStandIn(find(chart, "AnceRun")[0], NAMESPACE,
                     one(chart, "CustomResourceDefinition", "anceruns.ance-train.io")) as server:
        yield server


def test_trainer_crash_marks_the_run_failed(tmp_path: Path, standin: KubeStandIn,
                                            redis_server: RedisServer, tiny_model: Path,
                                            scifact_subset: Path) -> None:
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # loads no more: the trainer fails
    harness = Harness.prepare(tmp_path, redis_server.url, run_id="kube-crash",
                              data={"path": str(scifact_subset)}, model={"path": str(broken)})
    process = harness.spawn("trainer", "trainer", {
        "ANCE_ANCERUN": standin.name, "ANCE_K8S_NAMESPACE": NAMESPACE,
        "ANCE_KUBE_API": standin.url})
    try:
        code = process.wait(timeout=180)
    finally:
        stop(process)
    assert code == 1, harness.log("trainer")
    status = standin.status
    assert status["phase"] == "Failed"
    assert "trainer" in status["message"] and "Error" in status["message"]
    failed = [e for e in standin.events.values() if e["reason"] == "RunFailed"]
    assert len(failed) == 1 and failed[0]["type"] == "Warning"
    assert failed[0]["message"] == status["message"]


def test_other_roles_report_a_crash_as_service_failed(standin: KubeStandIn) -> None:
    reporter = RunReporter(KubeSettings(standin.name, NAMESPACE, standin.url), "indexer",
                           "indexer-0").start()
    reporter.failed(RuntimeError("disk full at s3://key:secret@bucket/x"))
    reporter.close()
    (event,) = standin.events.values()
    assert (event["reason"], event["type"]) == ("ServiceFailed", "Warning")
    assert "indexer indexer-0: RuntimeError: disk full" in event["message"]
    assert "key:secret" not in event["message"]  # URL userinfo is redacted
    assert "phase" not in standin.status  # only the trainer decides the run's phase


def test_trainer_ranks_report_their_world_size_once(tmp_path: Path, standin: KubeStandIn,
                                                    redis_server: RedisServer, tiny_model: Path,
                                                    scifact_subset: Path) -> None:
    """Two trainer ranks (gloo, started as the embedded mode and the chart's pods start them:
    torch.distributed.run ... -m ance_train.cli serve trainer): rank 0 reports the world size
    on the AnceRun, and the run's progress once, not once per rank."""
    steps, every = 4, 2
    harness = Harness.prepare(
        tmp_path, redis_server.url, run_id="kube-ranks",
        data={"path": str(scifact_subset), "dev_fraction": 0.2},
        model={"path": str(tiny_model), "max_query_length": 16, "max_doc_length": 32},
        training={"steps": steps, "batch_size": 8, "refresh_every": every, "warmup_steps": 1,
                  "torch_threads": 1, "processes": 2},
        negatives={"pool": "random", "per_query": 1, "warmup": "none"})
    launch = service_command("trainer", 2)
    command = [*launch.argv, "serve", "trainer", "--config",
               str(harness.config_path), "--instance", "trainer",
               "--work-dir", str(tmp_path / "work")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={
        **harness.env(), **launch.env, "ANCE_ANCERUN": standin.name,
        "ANCE_K8S_NAMESPACE": NAMESPACE, "ANCE_KUBE_API": standin.url})
    # The first failure is what matters when torchrun restarted the ranks: head and tail.
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[:5000] + done.stderr[-5000:]
    status = standin.status
    assert status["worldSize"] == 2
    assert (status["phase"], status["step"], status["totalSteps"]) == ("Succeeded", steps, steps)
    assert {s.get("worldSize") for s in standin.statuses} <= {None, 2}
    reasons = [e["reason"] for e in standin.events.values()]
    assert reasons.count("CheckpointPublished") == steps // every + 1  # 0, 2, 4: rank 0 only
    assert reasons.count("RunSucceeded") == 1
    assert standin.pruned == set() and standin.rejected == []


def test_a_rank_failure_torchrun_restarts_does_not_fail_the_run(
        standin: KubeStandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer rank dies with torch.distributed.run restarts left: a RankFailed warning, the
    phase untouched; with none left (or a single process), the run fails."""
    env = {"WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "2"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert ranks_restart_on_failure()
    reporter = RunReporter(KubeSettings(standin.name, NAMESPACE, standin.url), "trainer",
                           "trainer-0").start()
    reporter.failed(RuntimeError("Connection closed by peer"),
                    restarting=ranks_restart_on_failure())
    reporter.close()
    (event,) = standin.events.values()
    assert (event["reason"], event["type"]) == ("RankFailed", "Warning")
    assert "phase" not in standin.status
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")  # the last restart is used up
    assert not ranks_restart_on_failure()
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert not ranks_restart_on_failure()
