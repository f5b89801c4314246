"""Refuse early what would fail late: free disk for the embedded run's store (predicted from
``plan``'s sizes and retention) before the run starts, and for each checkpoint before the
trainer writes it (docs/deployment.md, "Disk")."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from ance_train.config import ModelConfig, load_config, parse_config
from ance_train.data.validation import validate_dataset
from ance_train.index.capacity import encoder_size, plan, run_store_bytes, workload
from ance_train.infra.bus import WorkQueue
from ance_train.infra.disk import DiskUsage, InsufficientDisk, tree_bytes
from ance_train.infra.store import LocalStore
from ance_train.launcher.embedded import EmbeddedRun
from ance_train.modeling.model import BiEncoder, load_tokenizer
from ance_train.trainer.checkpoints import (
    CheckpointPublisher,
    checkpoint_bytes,
    latest_complete_checkpoint,
)
from ance_train.trainer.interpolation import floating_weights
from ance_train.trainer.training_state import TrainingState

from ance_train_dev.helpers import write_config


def test_store_need_is_plan_storage_times_what_retention_keeps(scifact_subset: Path) -> None:
    raw = {"data": {"path": str(scifact_subset)}, "training": {"steps": 1000,
                                                                "refresh_every": 100}}
    sizes = {"docs": 5000, "train_queries": 800, "eval_queries": 300, "dim": 384,
             "model_params": 22_000_000}
    per = plan(workload(docs=5000, dim=384, replicas=1, docs_per_s=1.0, train_queries=800,
                        eval_queries=300, model_params=22_000_000, embedding_bytes=2,
                        config=parse_config(raw))).storage_bytes
    refresh = per["total"] - per["checkpoint"]
    keep_all = run_store_bytes(parse_config(raw), **sizes)
    assert keep_all.checkpoints == 11  # step 0 and every 100 steps
    assert keep_all.parts == {"checkpoints": 11 * per["checkpoint"], "refreshes": 11 * refresh}
    bounded = run_store_bytes(parse_config({**raw, "store": {"keep_checkpoints": 2,
                                                             "keep_refreshes": 1}}), **sizes)
    assert (bounded.kept_checkpoints, bounded.kept_refreshes) == (4, 2)
    assert bounded.total == 4 * per["checkpoint"] + 2 * refresh < keep_all.total


def _config(tmp_path: Path, scifact_subset: Path, tiny_model: Path, **store: int) -> Path:
    return write_config(tmp_path / "config.yaml", run_id="disk-check",
                        output_dir=str(tmp_path / "runs"), data={"path": str(scifact_subset)},
                        model={"path": str(tiny_model)},
                        training={"steps": 10_000_000, "refresh_every": 1}, store=store)


def test_run_needing_more_disk_than_free_is_refused_before_it_starts(
        tmp_path: Path, scifact_subset: Path, tiny_model: Path) -> None:
    """Real free space: ten million checkpoints of even the tiny model fill any disk."""
    config_path = _config(tmp_path, scifact_subset, tiny_model)
    run_dir = tmp_path / "runs" / "disk-check"
    run_dir.mkdir(parents=True)
    (run_dir / "previous-run.txt").write_text("kept")
    with pytest.raises(InsufficientDisk) as info:
        EmbeddedRun(load_config(config_path), config_path, overwrite=True).prepare()
    message = str(info.value)
    assert "not enough free disk for run disk-check's store" in message
    assert f"at {run_dir / 'store'}: needs about" in message
    assert "10000001 checkpoints" in message and "GB free on the filesystem of" in message
    assert "store.keep_checkpoints (now None)" in message
    assert "store.keep_refreshes (now None)" in message
    # Nothing was touched: the previous run is still there, no staging directory is left.
    assert (run_dir / "previous-run.txt").read_text() == "kept"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["disk-check"]


def test_retention_bounds_the_need_so_the_same_run_starts(
        tmp_path: Path, scifact_subset: Path, tiny_model: Path) -> None:
    config_path = _config(tmp_path, scifact_subset, tiny_model, keep_checkpoints=1,
                          keep_refreshes=1)
    run = EmbeddedRun(load_config(config_path), config_path)
    try:
        run.prepare()
        assert (run.run_dir / "store").parent.is_dir()
        # The same check with a disk that is nearly full (an injected free-space number: no
        # disk can be filled on demand here) refuses, naming the numbers.
        with pytest.raises(InsufficientDisk, match=r"needs about [\d.]+ MB, 0\.0 MB free"):
            run._check_disk(run.run_dir / "cache",
                            disk_usage=lambda _path: DiskUsage(10**12, 10**12, 1000))
    finally:
        run.stop()


def test_checkpoint_estimate_matches_what_save_writes(tmp_path: Path, tiny_model: Path,
                                                      scifact_subset: Path, bus) -> None:
    config = parse_config({"data": {"path": str(scifact_subset)},
                           "model": {"path": str(tiny_model)}})
    dataset = validate_dataset(config.data, tmp_path / "cache")
    model = BiEncoder.from_pretrained(tiny_model, ModelConfig(path=str(tiny_model)))
    tokenizer = load_tokenizer(tiny_model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = tokenizer(["a query"], return_tensors="pt")
    model(batch["input_ids"], batch["attention_mask"]).sum().backward()
    optimizer.step()

    def state(step: int) -> TrainingState:
        return TrainingState(step=step, optimizer=optimizer.state_dict(), scheduler={},
                             rng={}, batches={})

    store = LocalStore("disk-check", tmp_path / "store")
    publisher = CheckpointPublisher(store, bus, WorkQueue(bus, 60.0), config, dataset,
                                    tmp_path / "work")
    try:
        estimate = checkpoint_bytes(model, state(1))
        params, _ = encoder_size(tiny_model)
        assert estimate >= 3 * 4 * params * 0.99  # float32 weights + AdamW's two moments
        # A WiSE-FT checkpoint (training.wise_ft_alpha < 1) also stores the trained weights.
        blended = state(1)
        blended.trained_weights = floating_weights(model)
        assert checkpoint_bytes(model, blended) - estimate == sum(
            t.numel() * t.element_size() for t in blended.trained_weights.values())
        published = publisher.publish(1, model, tokenizer, state(1))
        directory = publisher.local_dir / "1"
        written = tree_bytes(directory)
        tensors = sum(f.stat().st_size for f in directory.iterdir()
                      if f.suffix == ".safetensors")
        assert math.isclose(tensors, estimate, rel_tol=0.02), (tensors, estimate, written)
        free = shutil.disk_usage(tmp_path).free
        # 1.5 checkpoints free: one fits, but not with its copy in the local store.
        with pytest.raises(InsufficientDisk) as info:
            publisher.publish(2, model, tokenizer, state(2),
                              disk_usage=lambda _path: DiskUsage(free, 0, int(1.5 * estimate)))
        assert (f"not enough free disk for checkpoint 2 at {tmp_path / 'work' / 'checkpoints'}"
                in str(info.value))
        assert "store.keep_checkpoints" in str(info.value)
        # What was produced before is kept: checkpoint 1 is complete in the store, and no
        # half-written checkpoint 2 exists.
        assert published.done() and published.result() is True
        assert latest_complete_checkpoint(store) == 1
        assert not (tmp_path / "work" / "checkpoints" / "2").exists()
    finally:
        publisher.close()
