"""Issue 33 items 1 and 2: a budget that follows the data (``training.epochs``, early stopping
on dev) and selection not fooled by a tiny dev set (the dev floor, bootstrap intervals in the
eval reports, ``bench/quality.py --select``).

Unit tests of the decision functions on real eval reports in a LocalStore, and ONE short real
embedded run (tiny BERT, SciFact subset) whose budget is given in epochs and which must stop
early (``min_delta`` 1.0: no checkpoint can improve by that much)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ance_train.config import (
    MIN_DEV_QUERIES,
    SMALL_TRAIN_LEARNING_RATE,
    SMALL_TRAIN_QUERIES,
    SMALL_TRAIN_WISE_FT_ALPHA,
    ConfigError,
    EarlyStoppingConfig,
    TrainingConfig,
    load_config,
    parse_config,
    resolve_budget,
    steps_per_epoch,
)
from ance_train.data.dataset import load_dataset_index
from ance_train.evaluation import bootstrap_ci, evaluate_with_interval
from ance_train.infra.store import LocalStore
from ance_train.protocol import keys
from ance_train.trainer.early_stopping import decide, stored_evaluations

from ance_train_dev.helpers import write_config
from ance_train_dev.quality import select_checkpoint


def _config(**training) -> dict:
    return {"data": {"path": "/nowhere"}, "training": training,
            "negatives": {"pool": "ann", "warmup": "none"}}


# -- training.epochs ----------------------------------------------------------------------

def test_epochs_resolve_to_steps_of_the_training_queries() -> None:
    cfg = parse_config(_config(epochs=3, batch_size=8, refresh_every=5))
    assert cfg.training.steps is None
    with pytest.raises(ValueError, match="not resolved"):
        _ = cfg.training.total_steps
    resolved = resolve_budget(cfg, 42)  # ceil(42 / 8) = 6 steps per epoch
    assert resolved.training.steps_per_epoch == 6
    assert resolved.training.total_steps == 18
    assert resolved.training.checkpoint_steps() == [0, 5, 10, 15, 18]  # the last one always
    assert resolved.training.is_checkpoint_step(18) and not resolved.training.is_checkpoint_step(17)
    assert resolve_budget(cfg, 40).training.total_steps == 15  # an exact fit
    assert resolve_budget(cfg, 3).training.total_steps == 3  # the batch capped at 3 queries
    assert steps_per_epoch(17, 4) == 5
    # the configuration keeps epochs (what the services receive and resume compares)
    assert resolved.model_dump()["training"]["epochs"] == 3


def test_steps_and_epochs_exclude_each_other_and_steps_stays_the_default() -> None:
    with pytest.raises(ConfigError, match="not both"):
        parse_config(_config(epochs=2, steps=10))
    cfg = parse_config(_config())
    assert cfg.training.total_steps == 1000 and cfg.training.epochs is None
    assert resolve_budget(cfg, 10).training.total_steps == 1000
    warm = parse_config({**_config(epochs=1, batch_size=8),
                         "negatives": {"pool": "ann", "warmup": "bm25", "warmup_steps": 5}})
    with pytest.raises(ConfigError, match="warmup_steps"):
        resolve_budget(warm, 16)  # 2 steps: the warm-up cannot fit


def test_early_stopping_needs_the_dev_split() -> None:
    with pytest.raises(ConfigError, match="dev"):
        parse_config({**_config(early_stopping={"patience": 2}),
                      "index": {"eval_splits": ["test"]}})
    cfg = parse_config(_config(early_stopping={"patience": 2}))
    assert cfg.training.early_stopping.metric == "ndcg@10"


# -- early stopping -----------------------------------------------------------------------

def _reports(tmp_path: Path, values: list[float], every: int = 10) -> LocalStore:
    store = LocalStore("es", tmp_path)
    for n, value in enumerate(values):
        store.put_json(keys.eval_report(n * every),
                       {"step": n * every, "metrics": {"dev": {"ndcg@10": value},
                                                       "test": {"ndcg@10": 0.9}}})
    store.put_json("eval-other.json", {"not": "a report"})
    return store


def test_early_stopping_after_exactly_patience_non_improving_evaluations(tmp_path) -> None:
    settings = EarlyStoppingConfig(patience=3, min_delta=0.01)
    # 0.30 → 0.40 improves; 0.405 (not by 0.01), 0.39, 0.41 (not by 0.01): the third stops
    values = [0.30, 0.40, 0.405, 0.39, 0.409, 0.50]
    store = _reports(tmp_path, values)
    evaluations = stored_evaluations(store, "ndcg@10")
    assert evaluations == [(10 * n, v) for n, v in enumerate(values)]
    for seen in range(1, 5):  # up to checkpoint 30: two non-improving, no stop
        decision = decide(evaluations[:seen], settings)
        assert not decision.stop
    assert decide(evaluations[:4], settings).non_improving == 2
    stop = decide(evaluations[:5], settings)
    assert stop.stop and stop.decided_at == 40 and stop.non_improving == 3
    assert (stop.best_step, stop.best_value) == (10, 0.40)
    # the decision never changes once made (the later improvement is after it)
    assert decide(evaluations, settings) == stop
    # re-derived the same from the store, up to a step (a restarted trainer)
    assert decide(stored_evaluations(store, "ndcg@10", up_to=40), settings) == stop
    assert not decide(stored_evaluations(store, "ndcg@10", up_to=30), settings).stop


def test_an_improvement_resets_the_patience(tmp_path) -> None:
    settings = EarlyStoppingConfig(patience=2, min_delta=0.0)
    evaluations = stored_evaluations(_reports(tmp_path, [0.3, 0.3, 0.31, 0.30, 0.32, 0.3]),
                                     "ndcg@10")
    decision = decide(evaluations, settings)
    assert not decision.stop and decision.best_step == 40 and decision.non_improving == 1


# -- bootstrap intervals ------------------------------------------------------------------

def test_bootstrap_interval_contains_the_mean_narrows_and_is_deterministic() -> None:
    rng = np.random.default_rng(7)
    small, large = rng.uniform(0, 1, 40), rng.uniform(0, 1, 1000)
    for scores in (small, large):
        low, high = bootstrap_ci(scores)
        assert low <= float(np.mean(scores)) <= high
    assert bootstrap_ci(small) == bootstrap_ci(small)  # fixed seed
    width = lambda interval: interval[1] - interval[0]  # noqa: E731
    assert width(bootstrap_ci(large)) < width(bootstrap_ci(small)) / 3  # ~ 1/sqrt(n)
    with pytest.raises(ValueError):
        bootstrap_ci([])


def test_evaluation_interval_is_of_the_reported_ndcg() -> None:
    qrels = {f"q{i}": {f"d{i}": 1} for i in range(30)}
    run = {f"q{i}": {f"d{i}": 1.0} if i % 3 else {"x": 1.0, f"d{i}": 0.5} for i in range(30)}
    metrics, (low, high) = evaluate_with_interval(run, qrels)
    assert low <= metrics["ndcg@10"] <= high < 1.0


# -- selection ------------------------------------------------------------------------------

def _refresh(step: int, value: float, ci: tuple[float, float] | None = None) -> dict:
    return {"step": step, "metrics": {"dev": {"ndcg@10": value}},
            "ci95": {"dev": {"ndcg@10": list(ci)}} if ci else {}}


def test_selection_rules_within_the_dev_noise() -> None:
    refreshes = [_refresh(0, 0.20), _refresh(10, 0.41), _refresh(20, 0.44),
                 _refresh(30, 0.45, (0.40, 0.50)), _refresh(40, 0.43), _refresh(50, 0.39)]
    assert select_checkpoint(refreshes)["step"] == 30  # the default: best
    assert select_checkpoint(refreshes, "earliest-within-noise")["step"] == 10
    assert select_checkpoint(refreshes, "latest-within-noise")["step"] == 40  # 50 is below
    assert select_checkpoint(refreshes, "last")["step"] == 50
    no_interval = [{**r, "ci95": {}} for r in refreshes]
    assert select_checkpoint(no_interval, "earliest-within-noise")["step"] == 30
    assert select_checkpoint(no_interval, "latest-within-noise")["step"] == 30
    with pytest.raises(ValueError):
        select_checkpoint(refreshes, "latest")


# -- the small-dev warning ------------------------------------------------------------------

def _ance(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ance_train.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def test_validate_warns_of_a_small_dev_set_and_shows_the_resolved_budget(
        tmp_path: Path, scifact_subset, tiny_model) -> None:
    config = write_config(tmp_path / "c.yaml", run_id="smalldev",
                          output_dir=str(tmp_path / "runs"),
                          data={"path": str(scifact_subset), "dev_fraction": 0.1},
                          model={"path": str(tiny_model)},
                          training={"epochs": 2, "batch_size": 8},
                          negatives={"pool": "ann", "warmup": "none"})
    result = _ance("validate", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert f"below {MIN_DEV_QUERIES}" in result.stderr.replace("\n", " ")
    assert "2 epochs ×" in result.stdout
    # The default learning rate (1e-5) is already at or below the small-set one: no advice.
    assert "training.learning_rate=" not in result.stderr


def test_validate_advises_a_lower_learning_rate_on_a_small_training_set(
        tmp_path: Path, scifact_subset, tiny_model) -> None:
    config = write_config(tmp_path / "c.yaml", run_id="smalltrain",
                          output_dir=str(tmp_path / "runs"),
                          data={"path": str(scifact_subset)}, model={"path": str(tiny_model)},
                          training={"steps": 10, "learning_rate": 5e-5},
                          negatives={"pool": "ann", "warmup": "none"})
    result = _ance("validate", "--config", str(config))
    assert result.returncode == 0, result.stderr
    stderr = " ".join(result.stderr.split())
    assert f"training queries, below {SMALL_TRAIN_QUERIES}" in stderr
    assert "at training.learning_rate 5e-05" in stderr
    assert f"--set training.learning_rate={SMALL_TRAIN_LEARNING_RATE:g}" in stderr
    assert "wise_ft_alpha auto" not in stderr  # the default is 1: no blend, no note


def test_wise_ft_alpha_auto_blends_below_the_small_set_threshold(
        tmp_path: Path, scifact_subset, tiny_model) -> None:
    training = TrainingConfig(wise_ft_alpha="auto")
    assert training.wise_ft_alpha_for(SMALL_TRAIN_QUERIES - 1) == SMALL_TRAIN_WISE_FT_ALPHA
    assert training.wise_ft_alpha_for(SMALL_TRAIN_QUERIES) == 1.0
    assert TrainingConfig(wise_ft_alpha=0.7).wise_ft_alpha_for(10) == 0.7  # given: kept
    config = write_config(tmp_path / "c.yaml", run_id="smallblend",
                          output_dir=str(tmp_path / "runs"),
                          data={"path": str(scifact_subset)}, model={"path": str(tiny_model)},
                          training={"steps": 10, "wise_ft_alpha": "auto"},
                          negatives={"pool": "ann", "warmup": "none"})
    result = _ance("validate", "--config", str(config))
    assert result.returncode == 0, result.stderr
    stderr = " ".join(result.stderr.split())
    assert (f"training.wise_ft_alpha auto publishes every checkpoint as θ0 + "
            f"{SMALL_TRAIN_WISE_FT_ALPHA:g} (θ − θ0)") in stderr


# -- one real run: epochs + early stopping ---------------------------------------------------

@pytest.mark.e2e
def test_a_run_in_epochs_stops_early_and_the_launcher_exits_cleanly(
        tmp_path: Path, scifact_subset, tiny_model) -> None:
    config_path = write_config(
        tmp_path / "config.yaml", run_id="early", output_dir=str(tmp_path / "runs"),
        data={"path": str(scifact_subset), "dev_fraction": 0.2},
        model={"path": str(tiny_model), "max_query_length": 16, "max_doc_length": 32},
        training={"epochs": 200, "batch_size": 8, "refresh_every": 20, "warmup_steps": 2,
                  "learning_rate": 1e-4, "torch_threads": 1,
                  "early_stopping": {"patience": 1, "min_delta": 1.0}},
        negatives={"pool": "ann", "per_query": 1, "warmup": "none", "top_k": 20},
        inference={"replicas": 1, "shard_size": 100, "claim_timeout_s": 10,
                   "torch_threads": 1},
        index={"eval_depth": 50}, store={"keep_checkpoints": 3})
    result = _ance("run", "--config", str(config_path), "--max-minutes", "6", timeout=480)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "early"
    dataset = load_dataset_index(run_dir / "cache")
    budget = 200 * math.ceil(dataset.trainable_queries / 8)
    summary = json.loads((run_dir / "summary.json").read_text())
    trainer = summary["trainer"]
    assert trainer["budget"] == {"steps": budget, "epochs": 200,
                                 "steps_per_epoch": budget // 200}
    stopped = trainer["stopped_early"]
    assert trainer["finished"] and stopped is not None
    # min_delta 1.0: checkpoint 0 stays the best; the first later evaluation stops the run
    evaluated = sorted(e["step"] for e in summary["evaluations"])
    assert stopped["best_step"] == 0 and stopped["decided_at"] == evaluated[1]
    assert stopped["decided_at"] < stopped["at_step"] == trainer["steps"] < budget
    assert trainer["checkpoints"][-1] == stopped["at_step"]
    # the final checkpoint was evaluated (what the launcher waits for), with its interval
    store = LocalStore("early", run_dir / "store")
    report = store.get_json(keys.eval_report(stopped["at_step"]))
    low, high = report["ci95"]["dev"]["ndcg@10"]
    assert low <= report["metrics"]["dev"]["ndcg@10"] <= high
    assert stopped["at_step"] == evaluated[-1]
    assert load_config(config_path).training.epochs == 200
