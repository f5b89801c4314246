"""`ance-train prepare` (the trainer pod's init step) publishes the dataset index to a real S3
store (moto, through the minio client); a service started before it waits, then proceeds, and
gives up with a clear error when the index never comes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from ance_train.data.validation import validate_dataset
from ance_train.infra.bus import EventBus, connect
from ance_train.launcher.redis_server import RedisServer
from ance_train.protocol.keys import DATASET_INDEX as DATASET_INDEX_KEY
from ance_train.protocol.keys import DATASET_INDEX_FILE
from ance_train.protocol.keys import DOC_OFFSETS as DOC_OFFSETS_KEY

from ance_train_dev.helpers import write_config
from ance_train_dev.service_harness import Harness, stop, wait_registered, wait_until


def make_harness(root: Path, run_id: str, redis: RedisServer, s3_env: dict[str, str],
                 tiny_model: Path, scifact_subset: Path) -> Harness:
    """A run whose dataset is *not* published yet."""
    config_path = write_config(root / "config.yaml", run_id=run_id,
                               data={"path": str(scifact_subset)},
                               model={"path": str(tiny_model)},
                               inference={"torch_threads": 1})
    return Harness(root, config_path, redis.url, dict(s3_env))


def prepare(harness: Harness) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ance_train.cli", "prepare", "--config",
                           str(harness.config_path)], capture_output=True, text=True,
                          env=harness.env(), timeout=180)


def test_prepare_publishes_the_dataset_index_and_is_idempotent(
        tmp_path: Path, redis_server: RedisServer, s3_env: dict[str, str], tiny_model: Path,
        scifact_subset: Path) -> None:
    harness = make_harness(tmp_path, "prepare-twice", redis_server, s3_env, tiny_model,
                           scifact_subset)
    store = harness.store
    assert not store.exists(DATASET_INDEX_KEY)
    first = prepare(harness)
    assert first.returncode == 0, first.stderr
    expected = validate_dataset(harness.config.data, tmp_path / "local",
                                seed=harness.config.data.split_seed)
    assert f"{expected.num_docs} docs" in first.stdout
    published = store.get_bytes(DATASET_INDEX_KEY)
    assert published == (tmp_path / "local" / DATASET_INDEX_FILE).read_bytes()
    offsets = store.get_bytes(DOC_OFFSETS_KEY)
    second = prepare(harness)
    assert second.returncode == 0, second.stderr
    assert store.get_bytes(DATASET_INDEX_KEY) == published
    assert store.get_bytes(DOC_OFFSETS_KEY) == offsets


def test_service_started_first_waits_for_prepare_then_proceeds(
        tmp_path: Path, redis_server: RedisServer, s3_env: dict[str, str], tiny_model: Path,
        scifact_subset: Path) -> None:
    harness = make_harness(tmp_path, "prepare-later", redis_server, s3_env, tiny_model,
                           scifact_subset)
    bus = EventBus(connect(redis_server.url), harness.config.run_id)
    process = harness.spawn("inferencer", "inf-early")
    try:
        wait_until(lambda: "waiting for the dataset index" in harness.log("inf-early")
                   or process.poll() is not None, 120, "the inferencer says it waits")
        time.sleep(2.0)
        assert process.poll() is None, harness.log("inf-early")
        assert bus.services() == {}  # not serving without the dataset index
        result = prepare(harness)
        assert result.returncode == 0, result.stderr
        wait_registered(harness, bus, process, "inferencer", "inf-early")  # it proceeds
    finally:
        stop(process)
    log = harness.log("inf-early")
    assert log.count("waiting for the dataset index") == 1  # logged once, not per poll
    assert "dataset index found" in log


def test_service_gives_up_with_a_clear_error(tmp_path: Path, redis_server: RedisServer,
                                             s3_env: dict[str, str], tiny_model: Path,
                                             scifact_subset: Path) -> None:
    harness = make_harness(tmp_path, "prepare-never", redis_server, s3_env, tiny_model,
                           scifact_subset)
    process = harness.spawn("indexer", "idx-late", {"ANCE_DATASET_TIMEOUT_S": "3"})
    try:
        code = process.wait(timeout=120)
    finally:
        stop(process)
    log = harness.log("idx-late")
    assert code == 1, log
    assert "no dataset index (data/dataset.json)" in log
    assert "ance-train prepare" in log and "ANCE_DATASET_TIMEOUT_S" in log
    assert "Traceback" not in log
