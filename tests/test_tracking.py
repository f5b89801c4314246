"""Run tracking without a run: the TensorBoard tracker writing to / uploading into a store,
the config's report_to checks, and how nested values become tags. A whole run's event files
are checked in tests/test_e2e.py."""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ance_train.config import ConfigError, parse_config
from ance_train.infra.store import LocalStore, store_from_env
from ance_train.observability.tracking import (
    TENSORBOARD_DIR_VAR,
    TensorBoardTracker,
    flatten,
    open_tracking,
    tensorboard_dir,
)
from ance_train.protocol import keys


def scalars_in(directory: Path | str) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def config(**sections) -> object:
    return parse_config({"data": {"path": "/nowhere"}, **sections})


def test_store_backed_tracker_uploads_event_files_readable_by_tensorboard(tmp_path) -> None:
    store = LocalStore("run-1", tmp_path / "store")
    tracker = TensorBoardTracker(tmp_path / "work" / "trainer", "trainer", store,
                                 upload_every_s=3600)
    for step in range(1, 4):
        tracker.scalars(step, {"train/loss": 1.0 / step, "skipped": float("nan")})
    tracker.flush()
    tracker.close()
    uploaded = [k for k in store.list(keys.TENSORBOARD) if not k.endswith(".sha256")]
    assert uploaded and all(k.startswith("tensorboard/trainer/events.out.tfevents") for k in
                            uploaded)
    download = tmp_path / "download"
    for key in uploaded:
        store.get_file(key, download / Path(key).name)
    scalars = scalars_in(download)
    assert set(scalars) == {"train/loss"}
    assert [(s, pytest.approx(v)) for s, v in scalars["train/loss"]] == [
        (1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]


def test_tensorboard_reads_the_uploaded_files_from_s3(tmp_path, s3_env, monkeypatch) -> None:
    """What the README promises: `tensorboard --logdir s3://<bucket>/<run_id>/tensorboard`
    with the usual S3 environment (TensorBoard's boto3 reader) shows a cluster run's files."""
    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    store = store_from_env("run-s3")
    tracker = TensorBoardTracker(tmp_path / "indexer", "indexer", store, upload_every_s=3600)
    tracker.scalars(15, {"eval/dev/ndcg@10": 0.25})
    tracker.close()
    # A fresh process: TensorBoard reads S3_ENDPOINT when its file systems are registered.
    env = {**os.environ, "S3_ENDPOINT": f"http://{s3_env['ANCE_S3_ENDPOINT']}",
           "AWS_ACCESS_KEY_ID": s3_env["ANCE_S3_ACCESS_KEY"],
           "AWS_SECRET_ACCESS_KEY": s3_env["ANCE_S3_SECRET_KEY"], "AWS_REGION": "us-east-1"}
    logdir = f"s3://{s3_env['ANCE_S3_BUCKET']}/run-s3/tensorboard/indexer"
    read = ("import sys; from tensorboard.backend.event_processing.event_accumulator import "
            "EventAccumulator as E; e = E(sys.argv[1]); e.Reload(); "
            "print([(s.step, round(s.value, 6)) for s in e.Scalars('eval/dev/ndcg@10')])")
    done = subprocess.run([sys.executable, "-c", read, logdir], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[(15, 0.25)]"


def test_tensorboard_tracker_does_not_import_torch(tmp_path) -> None:
    """The indexer writes its scalars with no torch (it needs none unless it serves a text
    query): importing torch would add ~2 s to each of its starts. A fresh interpreter, since
    this one has torch already."""
    script = ("import sys; from pathlib import Path; "
              "from ance_train.observability.tracking import TensorBoardTracker; "
              "t = TensorBoardTracker(Path(sys.argv[1]), 'indexer'); "
              "t.scalars(7, {'dev/ndcg@10': 0.5}); t.close(); "
              "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "indexer")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
    assert scalars_in(tmp_path / "indexer") == {"dev/ndcg@10": [(7, pytest.approx(0.5))]}


def test_where_event_files_go(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(TENSORBOARD_DIR_VAR, raising=False)
    assert tensorboard_dir(config(), tmp_path) == (tmp_path / "tensorboard", True)
    monkeypatch.setenv(TENSORBOARD_DIR_VAR, str(tmp_path / "run" / "tensorboard"))
    assert tensorboard_dir(config(), tmp_path) == (tmp_path / "run" / "tensorboard", False)
    logdir = str(tmp_path / "volume")
    assert tensorboard_dir(config(tracking={"logdir": logdir}), tmp_path) == (
        Path(logdir), False)


def test_report_to_nothing_tracks_nothing(tmp_path) -> None:
    tracking = open_tracking(config(tracking={"report_to": []}), "indexer", None, tmp_path)
    tracking.scalars(1, {"a": 1.0})
    tracking.close()
    assert tracking.trackers == [] and not (tmp_path / "tensorboard").exists()


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_missing_tracker_package_is_a_config_error_naming_it(tracker) -> None:
    with pytest.raises(ConfigError) as error:
        config(tracking={"report_to": ["tensorboard", tracker]})
    message = str(error.value)
    assert "tracking.report_to" in message and f"{tracker!r} package is not installed" in message
    assert "pip install 'ance-train[tracking]'" in message


def test_unknown_tracker_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"tracking\.report_to"):
        config(tracking={"report_to": ["comet"]})


def test_flatten_keeps_numbers_only() -> None:
    assert flatten({"dev": {"ndcg@10": 0.5}, "n": 3, "ok": True, "name": "x", "none": None},
                   "eval/") == {"eval/dev/ndcg@10": 0.5, "eval/n": 3.0}


def fake_module(monkeypatch, name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for key, value in attributes.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_wandb_and_mlflow_get_the_same_scalars(tmp_path, monkeypatch) -> None:
    """Stand-ins for the two packages (not installed here): the calls each tracker makes."""
    calls: list[tuple] = []

    class WandbRun:
        def log(self, values, step):
            calls.append(("wandb.log", step, values))

        def finish(self):
            calls.append(("wandb.finish",))

    def wandb_init(**kwargs):
        calls.append(("wandb.init", kwargs["name"], kwargs["group"]))
        return WandbRun()

    fake_module(monkeypatch, "wandb", init=wandb_init)
    fake_module(monkeypatch, "mlflow",
                set_experiment=lambda name: calls.append(("mlflow.experiment", name)),
                start_run=lambda run_name: calls.append(("mlflow.start", run_name)),
                log_params=lambda params: calls.append(("mlflow.params", params["run_id"])),
                log_metrics=lambda values, step: calls.append(("mlflow.log", step, values)),
                end_run=lambda: calls.append(("mlflow.end",)))
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv(TENSORBOARD_DIR_VAR, raising=False)
    run = config(run_id="tracked", tracking={"report_to": ["tensorboard", "wandb", "mlflow"]})
    tracking = open_tracking(run, "indexer", None, tmp_path)
    tracking.scalars(15, {"eval/dev/ndcg@10": 0.25, "refresh/period_s": 3.0})
    tracking.close()
    assert calls == [
        ("wandb.init", "tracked-indexer", "tracked"),
        ("mlflow.experiment", "tracked"), ("mlflow.start", "tracked-indexer"),
        ("mlflow.params", "tracked"),
        ("wandb.log", 15, {"eval/dev/ndcg@10": 0.25, "refresh/period_s": 3.0}),
        ("mlflow.log", 15, {"eval/dev/ndcg_at_10": 0.25, "refresh/period_s": 3.0}),
        ("wandb.finish",), ("mlflow.end",)]
    assert scalars_in(tmp_path / "tensorboard" / "indexer")["eval/dev/ndcg@10"] == [
        (15, 0.25)]
