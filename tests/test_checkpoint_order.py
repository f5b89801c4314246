"""A checkpoint is announced once its weights are stored; its training state follows
(trainer/checkpoints.py, protocol/checkpoints.py): ``WEIGHTS.json`` before
``checkpoint.published``, ``MANIFEST.json`` after the state; resume needs the full manifest,
encoding and export the weights manifest; retention deletes both manifests first and never a
checkpoint whose state may still be uploading; a local store hard-links the files."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import torch

from ance_train.config import ModelConfig, parse_config
from ance_train.data.validation import validate_dataset
from ance_train.infra.bus import EventBus, WorkQueue
from ance_train.infra.retention import RunRetention
from ance_train.infra.store import CorruptObject, LocalStore
from ance_train.modeling.checkpoint_cache import ModelCache, download_model
from ance_train.modeling.export import select_checkpoint
from ance_train.modeling.model import BiEncoder, load_tokenizer
from ance_train.protocol import keys
from ance_train.protocol.checkpoints import (
    Stored,
    complete_checkpoints,
    loadable_checkpoints,
    stored_checkpoints,
)
from ance_train.protocol.events import CheckpointPublished, EvalCompleted
from ance_train.protocol.retention import checkpoints_to_delete
from ance_train.trainer.checkpoints import CheckpointPublisher, latest_complete_checkpoint
from ance_train.trainer.training_state import TrainingState

WEIGHTS, MANIFEST = keys.CHECKPOINT_WEIGHTS_MANIFEST, keys.CHECKPOINT_MANIFEST


class Parts:
    """A publisher over a local store and real Redis, and the tiny model it checkpoints."""

    def __init__(self, tmp_path: Path, bus: EventBus, tiny_model: Path, scifact_subset: Path,
                 instance: str = "a") -> None:
        config = parse_config({"data": {"path": str(scifact_subset)},
                               "model": {"path": str(tiny_model)}})
        self.bus = bus
        self.store = LocalStore(bus.run_id, tmp_path / "store")
        self.model = BiEncoder.from_pretrained(tiny_model, ModelConfig(path=str(tiny_model)))
        self.tokenizer = load_tokenizer(tiny_model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.train_one_step()
        self.publisher = CheckpointPublisher(
            self.store, bus, WorkQueue(bus, 60.0), config,
            validate_dataset(config.data, tmp_path / "cache"), tmp_path / f"work-{instance}")

    def train_one_step(self) -> None:
        batch = self.tokenizer(["a query"], return_tensors="pt")
        self.model(batch["input_ids"], batch["attention_mask"]).sum().backward()
        self.optimizer.step()

    def state(self, step: int) -> TrainingState:
        return TrainingState(step=step, optimizer=self.optimizer.state_dict(), scheduler={},
                             rng={}, batches={})

    def publish(self, step: int, state: TrainingState | None = None) -> bool:
        future = self.publisher.publish(step, self.model, self.tokenizer,
                                        state or self.state(step))
        return future.result(timeout=60)


@pytest.fixture
def parts(tmp_path: Path, bus: EventBus, tiny_model: Path, scifact_subset: Path):
    made = Parts(tmp_path, bus, tiny_model, scifact_subset)
    yield made
    made.publisher.close()


def _announced(bus: EventBus) -> list[int]:
    return [r.event.step for r in bus.history(CheckpointPublished)]


def _stage(store: LocalStore, step: int) -> Stored | None:
    return stored_checkpoints(store.list(keys.CHECKPOINTS)).get(step)


class _StateHeldUntilAnnounced(TrainingState):
    """A training state whose save waits until the checkpoint is announced: the announcement
    must not wait for the state."""

    bus: EventBus
    seen_at_announce: list[str]

    def save(self, directory: Path) -> None:
        for _ in range(600):
            if self.step in _announced(self.bus):
                break
            threading.Event().wait(0.05)
        else:
            raise AssertionError("the checkpoint was not announced before its state was saved")
        super().save(directory)


def test_weights_manifest_then_announce_then_state_then_full_manifest(parts: Parts) -> None:
    seen: dict[str, object] = {}
    announce = parts.publisher._announce

    def snapshot_then_announce(step: int, **times: float | None) -> None:
        seen["listed"] = set(parts.store.list(keys.checkpoint(step)))
        seen["stage"] = _stage(parts.store, step)
        announce(step, **times)

    parts.publisher._announce = snapshot_then_announce  # type: ignore[method-assign]
    plain = parts.state(3)
    held = _StateHeldUntilAnnounced(**vars(plain))
    held.bus = parts.bus
    assert parts.publish(3, held) is True

    prefix = keys.checkpoint(3)
    listed = seen["listed"]
    assert isinstance(listed, set)
    assert f"{prefix}/{WEIGHTS}" in listed and f"{prefix}/model.safetensors" in listed
    assert f"{prefix}/{MANIFEST}" not in listed, "announced with the full manifest already"
    assert not any(keys.is_training_state(k.rsplit("/", 1)[1]) for k in listed)
    assert seen["stage"] is Stored.WEIGHTS
    # Once the publication is over: the state, then MANIFEST.json listing every file.
    assert _stage(parts.store, 3) is Stored.COMPLETE
    weights = parts.store.get_json(keys.checkpoint_weights_manifest(3))["files"]
    full = parts.store.get_json(keys.checkpoint_manifest(3))["files"]
    assert set(full) == set(weights) | set(keys.TRAINING_STATE_FILES)
    assert {rel: full[rel] for rel in weights} == weights
    assert latest_complete_checkpoint(parts.store) == 3
    assert _announced(parts.bus) == [3]
    event = next(r.event for r in parts.bus.history(CheckpointPublished))
    assert event.saved_at is not None and event.uploaded_at is not None
    assert event.save_started_at <= event.saved_at <= event.upload_started_at  # type: ignore
    assert event.uploaded_at <= event.published_at  # type: ignore[operator]


def test_a_checkpoint_whose_state_never_arrived_is_not_resumed_from(parts: Parts) -> None:
    assert parts.publish(2) is True
    broken = parts.state(4)

    def fail(directory: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    broken.save = fail  # type: ignore[method-assign]
    with pytest.raises(OSError, match="No space"):
        parts.publisher.publish(4, parts.model, parts.tokenizer, broken)
    with pytest.raises(OSError, match="No space"):
        parts.publisher.flush()
    # 4 was announced on its weights (encoding may use it), but never completed.
    assert _announced(parts.bus) == [2, 4]
    assert _stage(parts.store, 4) is Stored.WEIGHTS
    assert latest_complete_checkpoint(parts.store) == 2
    assert complete_checkpoints(parts.store.list(keys.CHECKPOINTS)) == [2]
    assert loadable_checkpoints(parts.store.list(keys.CHECKPOINTS)) == [2, 4]
    assert select_checkpoint(parts.store, "last") == 4  # export needs the weights only


def test_a_restarted_trainer_leaves_the_announced_checkpoint_it_comes_back_to(
        parts: Parts, tmp_path: Path, bus: EventBus, tiny_model: Path,
        scifact_subset: Path) -> None:
    """The trainer died between announcing 4 and storing its state: a new one resumes from 2
    and, at step 4 again, neither announces 4 twice nor replaces the weights its refresh
    used; 6 is published as always."""
    assert parts.publish(2) is True
    dead = parts.state(4)
    dead.save = lambda directory: (_ for _ in ()).throw(  # type: ignore[method-assign]
        RuntimeError("killed"))
    with pytest.raises(RuntimeError):
        parts.publisher.publish(4, parts.model, parts.tokenizer, dead)
    with pytest.raises(RuntimeError):
        parts.publisher.flush()
    parts.publisher.close()
    weights_of_4 = parts.store.get_json(keys.checkpoint_weights_manifest(4))

    second = Parts(tmp_path, bus, tiny_model, scifact_subset, instance="b")
    try:
        assert latest_complete_checkpoint(second.store) == 2
        second.train_one_step()  # the redone steps need not give the same weights
        assert second.publish(4) is False
        assert second.store.get_json(keys.checkpoint_weights_manifest(4)) == weights_of_4
        assert _stage(second.store, 4) is Stored.WEIGHTS
        assert second.publish(6) is True
    finally:
        second.publisher.close()
    assert _announced(bus) == [2, 4, 6], "a checkpoint was announced twice"
    assert latest_complete_checkpoint(second.store) == 6


def test_a_failed_announcement_still_completes_the_checkpoint(parts: Parts) -> None:
    """The state and MANIFEST.json are stored even when the announcement fails, so a
    restarted trainer resumes from it and announces it then (ensure_announced)."""
    def redis_down(step: int, **times: float | None) -> None:
        raise ConnectionError("redis is down")

    announce = parts.publisher._announce
    parts.publisher._announce = redis_down  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        parts.publish(5)
    assert _stage(parts.store, 5) is Stored.COMPLETE and _announced(parts.bus) == []
    parts.publisher._announce = announce  # type: ignore[method-assign]
    parts.publisher.ensure_announced(5)
    parts.publisher.ensure_announced(5)
    assert _announced(parts.bus) == [5] and parts.bus.latest_checkpoint() == 5


def test_encoders_read_the_weights_manifest_and_older_stores_the_full_one(
        parts: Parts, tmp_path: Path, tiny_model: Path) -> None:
    assert parts.publish(1) is True
    parts.store.delete(keys.checkpoint_manifest(1))  # as while its state is uploading
    target = tmp_path / "loaded"
    manifest = download_model(parts.store, 1, target)
    assert not any(keys.is_training_state(rel) for rel in manifest["files"])
    assert not any(keys.is_training_state(p.name) for p in target.iterdir())
    cache = ModelCache(parts.store, ModelConfig(path=str(tiny_model)), tmp_path / "cache",
                       torch.device("cpu"))
    model, _ = cache.get(1)
    assert torch.equal(next(model.parameters()), next(parts.model.parameters()))
    # A checkpoint stored before WEIGHTS.json existed: MANIFEST.json alone.
    parts.store.put_dir(keys.checkpoint(9), tiny_model)
    assert stored_checkpoints(parts.store.list(keys.CHECKPOINTS)) == {1: Stored.WEIGHTS,
                                                                     9: Stored.COMPLETE}
    assert set(download_model(parts.store, 9, tmp_path / "old")["files"]) == {
        p.relative_to(tiny_model).as_posix() for p in tiny_model.rglob("*") if p.is_file()}


def test_the_local_store_links_the_checkpoint_files(parts: Parts) -> None:
    assert parts.publish(7) is True
    local = parts.publisher.local_dir / "7" / "model.safetensors"
    stored = parts.store.root / parts.store.run_id / keys.checkpoint(7) / "model.safetensors"
    assert os.path.samefile(local, stored)  # one copy of the bytes on disk


def test_share_falls_back_to_a_copy_and_an_edit_in_place_is_corruption(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalStore("share", tmp_path / "store")
    source = tmp_path / "weights.bin"
    source.write_bytes(b"v1" * 1000)
    store.put_file("linked", source, share=True)
    assert os.path.samefile(source, store.root / "share" / "linked")
    with open(source, "r+b") as f:  # what a caller of share=True must never do
        f.write(b"XX")
    with pytest.raises(CorruptObject):
        store.get_bytes("linked")

    def cross_device(src: object, dst: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    source.write_bytes(b"v2" * 1000)
    store.put_file("copied", source, share=True)
    assert not os.path.samefile(source, store.root / "share" / "copied")
    assert store.get_bytes("copied") == b"v2" * 1000
    assert not [p for p in (store.root / "share").iterdir() if "tmp" in p.name]


def _objects(step: int, stage: Stored | None) -> list[str]:
    files = ["model.safetensors", "config.json", "training_state.safetensors"]
    files += {None: [], Stored.WEIGHTS: [WEIGHTS], Stored.COMPLETE: [WEIGHTS, MANIFEST]}[stage]
    return [f"{keys.checkpoint(step)}/{name}" for name in files]


def test_retention_rules_with_weights_only_checkpoints() -> None:
    metrics = {s: {"dev": {"ndcg@10": 0.1 + s / 100}} for s in (0, 2, 4, 6, 8)}
    # 4: its trainer died after announcing it (weights only), a newer one is complete;
    # 10: uploading its state now (weights only, the newest).
    stored = [k for s in (0, 2, 6, 8) for k in _objects(s, Stored.COMPLETE)]
    stored += _objects(4, Stored.WEIGHTS) + _objects(10, Stored.WEIGHTS)
    stored += _objects(12, None)  # an upload cut short: no checkpoint
    assert stored_checkpoints(stored) == {0: Stored.COMPLETE, 2: Stored.COMPLETE,
                                          4: Stored.WEIGHTS, 6: Stored.COMPLETE,
                                          8: Stored.COMPLETE, 10: Stored.WEIGHTS}
    # 8: newest evaluated, best and newest complete; 10 newer than it and still uploading.
    assert checkpoints_to_delete(stored, 1, metrics) == [0, 2, 4, 6]
    # keep 2: the two newest *complete* ones (6, 8), not 4 or 10, which cannot be resumed.
    assert checkpoints_to_delete(stored, 2, metrics) == [0, 2, 4]
    # A weights-only checkpoint newer than every complete one may be uploading: kept, even
    # once evaluated and superseded.
    uploading = _objects(0, Stored.COMPLETE) + _objects(2, Stored.WEIGHTS) + _objects(
        4, Stored.WEIGHTS)
    assert checkpoints_to_delete(uploading, 1, {0: {}, 2: {}, 4: {}}) == []


def test_retention_deletes_both_manifests_first(tmp_path: Path, bus: EventBus) -> None:
    store = LocalStore(bus.run_id, tmp_path / "store")
    for step, stage in ((0, Stored.COMPLETE), (2, Stored.WEIGHTS), (4, Stored.COMPLETE)):
        for key in _objects(step, stage):
            store.put_bytes(key, b"x")
    for step in (0, 2, 4):
        bus.publish(EvalCompleted(step=step, key=keys.eval_report(step),
                                  metrics={"dev": {"ndcg@10": 0.5 - step / 100}}))
    deleted: list[str] = []
    real_delete = store.delete

    def delete(key: str) -> None:
        deleted.append(key)
        real_delete(key)

    store.delete = delete  # type: ignore[method-assign]
    # 0: best; 4: newest complete and evaluated; 2 (weights only, older than 4) goes.
    sweep = RunRetention(bus, store, None, keep_checkpoints=1).sweep_checkpoints()
    assert deleted[:2] == [keys.checkpoint_manifest(2), keys.checkpoint_weights_manifest(2)]
    assert sorted(sweep.keys) == sorted(k for k in _objects(2, Stored.WEIGHTS))
    assert stored_checkpoints(store.list(keys.CHECKPOINTS)) == {0: Stored.COMPLETE,
                                                                4: Stored.COMPLETE}
