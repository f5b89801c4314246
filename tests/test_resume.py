"""Trainer resume: the pickle-free training state, and a resumed run that continues exactly.

The determinism test runs the real Trainer in this process against a real Redis server and
a local store: run A trains K+2 steps without interruption; run B stops after step K+1
(one step past checkpoint K, whose work is lost); a fresh Trainer C on B's run resumes from
checkpoint K. C's steps K+1 and K+2 must give A's losses and A's final weights, bit for bit.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import get_linear_schedule_with_warmup

from ance_train.config import ModelConfig, load_config
from ance_train.infra.bus import EventBus, connect
from ance_train.infra.store import LocalStore, store_from_env
from ance_train.launcher.embedded import EmbeddedRun, RunAborted
from ance_train.modeling.model import BiEncoder, load_tokenizer
from ance_train.protocol import keys
from ance_train.protocol.events import CheckpointPublished, RunFinished
from ance_train.runtime import ServiceOptions, connect_context
from ance_train.trainer.checkpoints import latest_complete_checkpoint
from ance_train.trainer.tensor_state import StateFormatError, load_state, save_state
from ance_train.trainer.trainer import Trainer
from ance_train.trainer.training_state import (
    STATE_JSON,
    STATE_TENSORS,
    NegativesInUse,
    TrainingState,
    capture_rng,
    restore_rng,
)

from ance_train_dev.helpers import write_config
from ance_train_dev.service_harness import Harness

K = 3  # checkpoint every K steps; the run is K + 2 steps long


def _assert_same(left: object, right: object, where: str = "state") -> None:
    """Deep equality that compares tensors and arrays by value (and dtype)."""
    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor) and left.dtype == right.dtype, where
        assert torch.equal(left, right), where
    elif isinstance(left, np.ndarray):
        assert isinstance(right, np.ndarray) and left.dtype == right.dtype, where
        np.testing.assert_array_equal(left, right, err_msg=where)
    elif isinstance(left, dict):
        assert isinstance(right, dict) and left.keys() == right.keys(), where
        for key in left:
            _assert_same(left[key], right[key], f"{where}.{key}")
    elif isinstance(left, list | tuple):
        assert type(left) is type(right) and len(left) == len(right), where
        for i, (a, b) in enumerate(zip(left, right, strict=True)):
            _assert_same(a, b, f"{where}[{i}]")
    else:
        assert left == right and type(left) is type(right), where


def _optimised(tiny_model: Path) -> tuple[BiEncoder, torch.optim.Optimizer, object]:
    model = BiEncoder.from_pretrained(tiny_model, _config(tiny_model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 2, 10)
    return model, optimizer, scheduler


def _config(tiny_model: Path) -> ModelConfig:
    return ModelConfig(path=str(tiny_model))


def _train_step(model: BiEncoder, optimizer, scheduler, tokenizer) -> float:
    """One step whose loss depends on dropout (torch RNG) and the weights."""
    model.train()
    tokens = tokenizer(["aspirin heart", "vitamin d bone density", "gene expression"],
                       padding=True, return_tensors="pt")
    embeddings = model(tokens["input_ids"], tokens["attention_mask"])
    loss = torch.nn.functional.cross_entropy(model.score(embeddings, embeddings),
                                             torch.arange(3))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    return float(loss.detach())


def test_state_files_round_trip_without_pickle(tiny_model: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(tiny_model)
    model, optimizer, scheduler = _optimised(tiny_model)
    for _ in range(2):
        _train_step(model, optimizer, scheduler, tokenizer)
    state = TrainingState(
        step=2, optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(),
        rng=capture_rng(),
        batches={"rng": np.random.default_rng(5).bit_generator.state,
                 "epoch_order": ["q1", "q2"], "cursor": 1},
        negatives=NegativesInUse(ann=0, dual=None, bm25=True, in_use=-1),
        record={"losses": [1.5, float("nan")], "swaps": [{"step": 1, "negatives_step": -1}]})
    state.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_JSON, STATE_TENSORS]
    json.loads((tmp_path / STATE_JSON).read_text())  # plain JSON ...
    with safe_open(str(tmp_path / STATE_TENSORS), "pt") as tensors:  # ... and safetensors
        names = set(tensors.keys())
    assert "state.rng.torch" in names
    assert sum(n.endswith(".exp_avg_sq") for n in names) == len(optimizer.state_dict()["state"])

    loaded = TrainingState.load(tmp_path)
    assert loaded.step == 2 and loaded.negatives == state.negatives
    _assert_same(state.optimizer, loaded.optimizer, "optimizer")
    _assert_same(state.scheduler, loaded.scheduler, "scheduler")
    _assert_same(state.batches, loaded.batches, "batches")
    _assert_same(state.rng, loaded.rng, "rng")
    assert loaded.record["swaps"] == state.record["swaps"]
    assert np.isnan(loaded.record["losses"][1])


def test_next_step_after_restore_matches_uninterrupted(tiny_model: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(tiny_model)
    torch.manual_seed(0)
    model, optimizer, scheduler = _optimised(tiny_model)
    for _ in range(3):
        _train_step(model, optimizer, scheduler, tokenizer)
    model.save(tmp_path / "ckpt", tokenizer)
    TrainingState(step=3, optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(),
                  rng=capture_rng(), batches={}).save(tmp_path / "ckpt")
    continued = [_train_step(model, optimizer, scheduler, tokenizer) for _ in range(2)]
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(123)  # a restarted process: different RNG, fresh optimizer
    random.seed(123)
    np.random.seed(123)
    state = TrainingState.load(tmp_path / "ckpt")
    resumed = BiEncoder.from_pretrained(tmp_path / "ckpt", _config(tiny_model))
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    resumed_scheduler = get_linear_schedule_with_warmup(resumed_optimizer, 2, 10)
    resumed_optimizer.load_state_dict(state.optimizer)
    resumed_scheduler.load_state_dict(state.scheduler)
    restore_rng(state.rng)
    again = [_train_step(resumed, resumed_optimizer, resumed_scheduler, tokenizer)
             for _ in range(2)]
    assert again == continued
    for name, tensor in resumed.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    assert resumed_scheduler.get_last_lr() == scheduler.get_last_lr()


def test_state_format_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(StateFormatError, match="function"):
        save_state({"f": len}, tmp_path / "s.json", tmp_path / "s.safetensors")
    save_state({"t": torch.ones(2)}, tmp_path / "s.json", tmp_path / "s.safetensors")
    (tmp_path / "s.json").write_text(json.dumps({"t": {"__tensor__": "state.other"}}))
    with pytest.raises(StateFormatError, match=r"state\.other"):
        load_state(tmp_path / "s.json", tmp_path / "s.safetensors")
    with pytest.raises(StateFormatError, match=r"training_state\.json"):
        TrainingState.load(tmp_path)


# --------------------------------------------------------------------------- the real Trainer


def _prepare(root: Path, run_id: str, redis_url: str, tiny_model: Path, data: Path,
             wise_ft_alpha: float = 1.0) -> Harness:
    root.mkdir()
    return Harness.prepare(
        root, redis_url, run_id=run_id, data={"path": str(data), "dev_fraction": 0.2},
        model={"path": str(tiny_model), "max_query_length": 16, "max_doc_length": 32},
        training={"steps": K + 2, "batch_size": 4, "refresh_every": K, "warmup_steps": 1,
                  "learning_rate": 1e-3, "torch_threads": 1, "mixed_precision": "off",
                  "wise_ft_alpha": wise_ft_alpha},
        negatives={"pool": "random", "per_query": 2, "warmup": "none"},
    )


def _trainer(harness: Harness, instance: str) -> Trainer:
    context = connect_context(ServiceOptions(
        role="trainer", config_path=str(harness.config_path), redis_url=harness.redis_url,
        work_dir=str(harness.root / "work" / instance), instance="trainer",
        store_dir=str(harness.root / "store")))
    return Trainer(context)


def _final_weights(harness: Harness, step: int = K + 2) -> dict[str, torch.Tensor]:
    """The model file of checkpoint ``step`` (the published weights)."""
    target = harness.root / f"checkpoint-{step}"
    harness.store.get_dir(keys.checkpoint(step), target)
    return load_file(str(target / "model.safetensors"))


def _run_until_past_checkpoint(harness: Harness):
    """Train until one step past checkpoint K, then stop: step K+1 is in no checkpoint."""
    trainer = _trainer(harness, "b")
    log_step = trainer._log_step

    def stop_after_the_step_past_checkpoint(*args, **kwargs) -> None:
        log_step(*args, **kwargs)
        if trainer.step == K + 1:
            trainer.ctx.stop.set()

    trainer._log_step = stop_after_the_step_past_checkpoint
    record = trainer.run()
    assert len(record.losses) == K + 1 and record.checkpoints == [0, K]
    assert latest_complete_checkpoint(harness.store) == K
    return record


def test_resume_picks_the_newest_checkpoint_with_a_manifest(tmp_path: Path) -> None:
    store = LocalStore("manifests", tmp_path)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    assert latest_complete_checkpoint(store) is None
    store.put_dir(keys.checkpoint(5), tmp_path / "ckpt")
    store.put_dir(keys.checkpoint(40), tmp_path / "ckpt")
    store.put_bytes(f"{keys.checkpoint(100)}/config.json", b"{}")  # upload cut short
    assert latest_complete_checkpoint(store) == 40


def test_stored_but_unannounced_checkpoint_is_announced_on_resume(
        tmp_path: Path, redis_server, tiny_model: Path, scifact_subset: Path) -> None:
    harness = _prepare(tmp_path / "run", "unannounced", redis_server.url, tiny_model,
                       scifact_subset)
    _run_until_past_checkpoint(harness)
    bus = EventBus(connect(redis_server.url), "unannounced")
    stream = bus.stream(CheckpointPublished)
    lost = [e.entry_id for e in bus.history(CheckpointPublished) if e.step == K]
    bus.client.xdel(stream, *lost)  # as if its announcement failed (stored complete anyway)
    assert [e.step for e in bus.history(CheckpointPublished)] == [0]
    _trainer(harness, "c").run()
    assert [e.step for e in bus.history(CheckpointPublished)] == [0, K, K + 2]
    assert bus.latest_checkpoint() == K + 2


def test_resumed_trainer_continues_exactly(tmp_path: Path, redis_server, tiny_model: Path,
                                           scifact_subset: Path) -> None:
    uninterrupted = _prepare(tmp_path / "a", "straight", redis_server.url, tiny_model,
                             scifact_subset)
    straight = _trainer(uninterrupted, "a").run()
    assert len(straight.losses) == K + 2 and straight.checkpoints == [0, K, K + 2]

    interrupted = _prepare(tmp_path / "b", "restarted", redis_server.url, tiny_model,
                           scifact_subset)
    lost = _run_until_past_checkpoint(interrupted)

    second = _trainer(interrupted, "c")
    assert second.resumed_from == K and second.step == K
    resumed = second.run()

    assert resumed.losses[:K + 1] == straight.losses[:K + 1]  # K from the checkpoint, K+1 redone
    assert resumed.losses[K:] == straight.losses[K:], "steps after resume differ"
    assert resumed.losses[K] == lost.losses[K]
    assert resumed.resumed_from == [K] and resumed.checkpoints == [0, K, K + 2]
    a, c = _final_weights(uninterrupted), _final_weights(interrupted)
    assert a.keys() == c.keys()
    for name in a:
        assert torch.equal(a[name], c[name]), name
    bus = EventBus(connect(redis_server.url), "restarted")
    published = [e.step for e in bus.history(CheckpointPublished)]
    assert published == [0, K, K + 2], "checkpoint K must not be republished on resume"
    summary = interrupted.store.get_json(keys.TRAINER_SUMMARY)
    assert summary["finished"] and summary["steps"] == K + 2
    assert summary["losses"] == resumed.losses and summary["resumed_from"] == [K]
    # Killed after announcing the end and restarted (by the supervisor, or a Job): the new
    # trainer resumes on the final checkpoint, trains nothing and announces the end once.
    assert [e.step for e in bus.history(RunFinished)] == [K + 2]
    after_end = _trainer(interrupted, "d")
    assert after_end.resumed_from == K + 2
    assert after_end.run().losses == resumed.losses
    assert [e.step for e in bus.history(RunFinished)] == [K + 2], "the end announced twice"
    assert bus.latest_checkpoint() == K + 2
    assert [e.step for e in bus.history(CheckpointPublished)] == [0, K, K + 2]


def test_launcher_never_resumes_an_earlier_run_left_in_s3(tmp_path: Path, s3_env, tiny_model,
                                                          scifact_subset, monkeypatch) -> None:
    """A new ``ance-train run`` with a run_id whose objects are still in S3 would resume from
    them: it is refused, and ``--overwrite`` deletes them first."""
    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    config_path = write_config(
        tmp_path / "config.yaml", run_id="stale-s3-run", output_dir=str(tmp_path / "runs"),
        data={"path": str(scifact_subset)}, model={"path": str(tiny_model)})
    config = load_config(config_path)
    store = store_from_env(config.run_id)
    old_checkpoint = f"{keys.checkpoint(40)}/{STATE_JSON}"
    store.put_bytes(old_checkpoint, b"{}")
    with pytest.raises(RunAborted, match="stale-s3-run"):
        EmbeddedRun(config, config_path).prepare()
    assert store.exists(old_checkpoint)
    run = EmbeddedRun(config, config_path, overwrite=True)
    try:
        run.prepare()
    finally:
        run.stop()
    assert not store.exists(old_checkpoint)
    assert store.list("checkpoints") == [] and store.list("data")  # only the new dataset


def test_interpolated_checkpoints_blend_the_start_and_leave_training_alone(
        tmp_path: Path, redis_server, tiny_model: Path, scifact_subset: Path) -> None:
    """training.wise_ft_alpha (trainer/interpolation.py). Random negatives do not depend on the
    published checkpoints, so a run at α = 0.5 must train exactly as one at α = 1; what it
    publishes is θ0 + 0.5 (θ − θ0), θ being the other run's weights; and a restarted run
    resumes from θ (the training state), not from the published blend."""
    plain = _prepare(tmp_path / "plain", "plain", redis_server.url, tiny_model, scifact_subset)
    trained = _trainer(plain, "a").run()
    blended = _prepare(tmp_path / "blend", "blend", redis_server.url, tiny_model, scifact_subset,
                       wise_ft_alpha=0.5)
    record = _trainer(blended, "a").run()
    assert record.losses == trained.losses, "the swap of weights at a checkpoint changed training"

    start = load_file(str(_stored(blended, keys.START_WEIGHTS, tmp_path / "start")))
    theta0 = _final_weights(blended, 0)
    for step in (K, K + 2):
        theta, published = _final_weights(plain, step), _final_weights(blended, step)
        assert theta.keys() == published.keys()
        moved = 0
        for name, value in theta.items():
            if not value.is_floating_point():
                assert torch.equal(published[name], value), name
                continue
            # The stored θ0 is named as the BiEncoder's state (the encoder under "encoder.").
            assert torch.equal(start[f"encoder.{name}"], theta0[name]), f"θ0 {name}"
            assert torch.allclose(published[name], theta0[name] + 0.5 * (value - theta0[name]),
                                  atol=1e-7), name
            moved += not torch.equal(value, theta0[name])
        assert moved, "training changed no weight: the blend would prove nothing"

    restarted = _prepare(tmp_path / "restart", "restart", redis_server.url, tiny_model,
                         scifact_subset, wise_ft_alpha=0.5)
    _run_until_past_checkpoint(restarted)
    resumed = _trainer(restarted, "c").run()
    assert resumed.losses == trained.losses, "resumed from the blend instead of θ"
    for name, value in _final_weights(blended).items():
        assert torch.equal(_final_weights(restarted)[name], value), name


def _stored(harness: Harness, key: str, path: Path) -> Path:
    harness.store.get_file(key, path)
    return path
