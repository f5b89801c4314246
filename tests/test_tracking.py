"""Run tracking without a run: the TensorBoard tracker writing to / uploading into a store,
the config's report_to checks, and how nested values become tags. A whole run's event files
are checked in tests/test_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ance_train.config import ConfigError, parse_config
from ance_train.infra.store import LocalStore
from ance_train.observability.tracking import (
    TENSORBOARD_DIR_VAR,
    TensorBoardTracker,
    flatten,
    open_tracking,
    tensorboard_dir,
)
from ance_train.protocol import keys


def scalars_in(directory: Path) -> dict[str, list[tuple[int, float]]]:
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
