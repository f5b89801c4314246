"""Every negative strategy through the real asynchronous loop (`ance-train run`, services as
OS processes, Redis, local object store), each with a check of what makes it that strategy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ance_train.config import load_config
from ance_train.data.dataset import load_dataset_index
from ance_train.infra.store import LocalStore
from ance_train.negatives.strategies.simans import simans_probabilities
from ance_train.negatives.table import PAD, SOURCE_CODE, NegativesTable

from ance_train_dev.helpers import write_config

pytestmark = pytest.mark.e2e

STEPS, REFRESH, BATCH = 20, 10, 8  # checkpoints 0, 10 and 20: two refreshes after zero-shot
# BM25 → ANCE switches to ANN negatives once checkpoint 0's refresh is done (about as long as
# 20 steps): with twice the steps the ANN negatives come in well before the run ends.
ANN_AFTER_WARMUP_STEPS = 40


def run_strategy(root: Path, data: Path, model: Path, negatives: dict, steps: int = STEPS,
                 training: dict | None = None, **model_cfg) -> dict:
    config_path = write_config(
        root / "config.yaml", run_id="strategy", output_dir=str(root / "runs"),
        data={"path": str(data), "dev_fraction": 0.2},
        model={"path": str(model), "max_query_length": 24, "max_doc_length": 96, **model_cfg},
        training={"steps": steps, "batch_size": BATCH, "refresh_every": REFRESH,
                  "warmup_steps": 3, "learning_rate": 1e-4, "torch_threads": 1,
                  **(training or {})},
        negatives={"top_k": 30, "bm25": {"top_k": 30}, "simans": {"top_k": 30},
                   "dance": {"top_k": 10}, "grad_norm_every": 5, **negatives},
        inference={"replicas": 1, "shard_size": 150, "claim_timeout_s": 10,
                   "torch_threads": 1},
        index={"eval_depth": 100, "eval_splits": ["dev"]},
    )
    result = subprocess.run([sys.executable, "-m", "ance_train.cli", "run", "--config",
                             str(config_path), "--max-minutes", "4"],
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    config = load_config(config_path)
    run_dir = root / "runs" / "strategy"
    store = LocalStore(config.run_id, run_dir / "store")
    summary = json.loads((run_dir / "summary.json").read_text())
    tables = {int(k.split("/")[1].removesuffix(".npz")): NegativesTable.from_bytes(
        store.get_bytes(k)) for k in store.list("negatives")
        if k.split("/")[1].removesuffix(".npz").isdigit()}
    return {"store": store, "summary": summary, "run_dir": run_dir, "trainer": summary["trainer"],
            "tables": dict(sorted(tables.items())),
            "dataset": load_dataset_index(run_dir / "cache"), "config": config}


def common_checks(run: dict) -> None:
    trainer, total = run["trainer"], run["config"].training.steps
    assert trainer["finished"] and trainer["steps"] == total
    steps = [e["step"] for e in run["summary"]["evaluations"]]
    assert steps[0] == 0 and steps[-1] == total
    for evaluation in run["summary"]["evaluations"]:
        assert 0.0 <= evaluation["metrics"]["dev"]["ndcg@10"] <= 1.0
    assert all(np.isfinite(trainer["losses"]))
    norms = trainer["grad_norms"]
    assert norms and all(set(n) == {"step", "bottom", "middle", "top"} for n in norms)
    assert all(n["top"] > 0 and n["bottom"] > 0 for n in norms)
    for table in run["tables"].values():
        for qid, row in zip(table.query_ids, table.candidates, strict=True):
            assert not set(run["dataset"].train[str(qid)]) & set(row[row != PAD].tolist())


# Pool in_batch (no mined negatives) runs end to end in tests/test_bench_quality.py, whose
# in-batch runs check what test_in_batch_only checked here (no table, no hard negative, no
# wait): its own run is saved.


def test_bm25_warmup_then_random(tmp_path, scifact_subset, small_model) -> None:
    """Also pool ``random`` on its own (was test_random_negatives, merged here to save an
    end-to-end run): after the warm-up the run trains on random negatives, per_query 2 of
    them, with no ANN table mined — that test's assertions, on the steps after the warm-up."""
    run = run_strategy(tmp_path, scifact_subset, small_model,
                       {"pool": "random", "per_query": 2, "warmup": "bm25", "warmup_steps": 10})
    common_checks(run)
    assert run["tables"] == {}, "pool random mines no ANN table"
    used = run["trainer"]["negatives_steps"]
    assert used[:10] == [-1] * 10, "BM25 negatives during the warm-up"
    assert used[10:] == [None] * (STEPS - 10), "random negatives (no table) afterwards"
    # per_query of them at every step: random ones after the warm-up, BM25 ones in it
    assert set(run["trainer"]["hard_negatives"]) == {BATCH * 2}


def test_bm25_negatives(tmp_path, scifact_subset, small_model) -> None:
    run = run_strategy(tmp_path, scifact_subset, small_model, {"pool": "bm25"})
    common_checks(run)
    assert run["tables"] == {}, "BM25 negatives are static: no ANN mining"
    assert [s["negatives_step"] for s in run["trainer"]["swaps"]] == [-1]
    table = NegativesTable.from_bytes(run["store"].get_bytes("negatives/bm25.npz"))
    assert (table.sources[table.candidates != PAD] == SOURCE_CODE["bm25"]).all()


def test_bm25_plus_random(tmp_path, scifact_subset, small_model) -> None:
    run = run_strategy(tmp_path, scifact_subset, small_model,
                       {"pool": "bm25_random", "per_query": 2})
    common_checks(run)
    assert set(run["trainer"]["hard_negatives"]) == {BATCH * 2}
    assert [s["negatives_step"] for s in run["trainer"]["swaps"]] == [-1]


def test_bm25_warmup_then_ance(tmp_path, scifact_subset, small_model) -> None:
    run = run_strategy(tmp_path, scifact_subset, small_model,
                       {"pool": "ann", "warmup": "bm25", "warmup_steps": 12},
                       steps=ANN_AFTER_WARMUP_STEPS,
                       training={"torch_threads_between_refreshes": 2})
    common_checks(run)
    # One thread while checkpoint 0 is encoded (step 1 starts on BM25 negatives meanwhile),
    # two once a refresh is evaluated and none of the trainer's checkpoints is being encoded.
    threads = run["trainer"]["torch_threads"]
    assert len(threads) == ANN_AFTER_WARMUP_STEPS and threads[0] == 1
    assert set(threads) == {1, 2}
    swaps = run["trainer"]["swaps"]
    assert swaps[0] == {"step": 1, "negatives_step": -1}
    ann = [s for s in swaps if s["negatives_step"] >= 0]
    assert ann and ann[0]["step"] > 12, "ANN negatives only after the BM25 warm-up steps"
    for table in run["tables"].values():
        valid = table.candidates != PAD
        counts = valid.sum(axis=1, keepdims=True)
        np.testing.assert_allclose(table.probabilities[valid],
                                   np.broadcast_to(1.0 / counts, valid.shape)[valid], rtol=1e-5)


def test_simans_with_dance(tmp_path, scifact_subset, small_model) -> None:
    """SimANS sampling and DANCE's dual loss in one run (cosine similarity, which both use):
    test_simans and test_dance were merged here to save an end-to-end run; SimANS is a
    sampling strategy and DANCE a loss, so neither changes what the other's checks read (the
    tables' probabilities; the dual tables and losses)."""
    run = run_strategy(tmp_path, scifact_subset, small_model,
                       {"pool": "ann", "sampling": "simans", "warmup": "none",
                        "dance": {"dual_weight": 0.1, "top_k": 10}},
                       similarity="cosine", temperature=0.05)
    common_checks(run)
    check_simans(run)
    check_dance(run)


def check_simans(run: dict) -> None:
    for table in run["tables"].values():
        expected = simans_probabilities(table.scores, table.candidates, table.positive_scores,
                                        0.5, 0.0)
        np.testing.assert_allclose(table.probabilities, expected, rtol=1e-5, atol=1e-7)
        valid = table.candidates != PAD
        assert valid.sum(axis=1).max() <= 30  # k of SimANS
        assert table.probabilities[valid].std() > 0, "SimANS is not uniform"


def test_ance_tele(tmp_path, scifact_subset, small_model) -> None:
    run = run_strategy(tmp_path, scifact_subset, small_model,
                       {"pool": "tele", "warmup": "none", "tele": {"max_candidates": 90}})
    common_checks(run)
    tables = list(run["tables"].values())
    first, later = tables[0], tables[1:]
    assert SOURCE_CODE["momentum"] not in first.sources, "episode 0 has no momentum (Eq. 7)"
    assert (first.sources == SOURCE_CODE["lookahead"]).any()
    assert later and any((t.sources == SOURCE_CODE["momentum"]).any() for t in later)
    for table in tables:
        sums = table.probabilities.sum(axis=1)
        np.testing.assert_allclose(sums[sums > 0], 1.0, rtol=1e-5)
    evaluations = {e["step"]: e for e in run["summary"]["evaluations"]}
    diagnostics = run["store"].get_json(f"eval/{tables[-1].step}.json")["diagnostics"]
    assert set(diagnostics["composition_by_source"]) >= {"ann", "lookahead"}
    assert "forgetting_rate" in diagnostics and "overlap_top100" in diagnostics
    assert evaluations[tables[-1].step]


def check_dance(run: dict) -> None:
    duals = [k for k in run["store"].list("negatives") if k.endswith("-dual.npz")]
    assert duals, "the indexer mines negative queries at each refresh"
    train_ids = sorted(run["dataset"].train)
    dual = NegativesTable.from_bytes(run["store"].get_bytes(duals[-1]))
    for doc, row in zip(dual.query_ids, dual.candidates, strict=True):
        queries = row[row != PAD]
        assert queries.max(initial=0) < len(train_ids), "candidates are training queries"
        owners = {q for q in train_ids if int(doc) in run["dataset"].train[q]}
        assert not owners & {train_ids[i] for i in queries}
    dual_losses = [x for x in run["trainer"]["dual_losses"] if x is not None]
    assert dual_losses and all(x > 0 for x in dual_losses)
    # The dual loss is in the run's TensorBoard files, at the steps that computed it.
    events = EventAccumulator(str(run["run_dir"] / "tensorboard" / "trainer"),
                              size_guidance={"scalars": 0})
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("train/dual_loss")}
    assert logged == pytest.approx({s: x for s, x in enumerate(run["trainer"]["dual_losses"], 1)
                                    if x is not None}, rel=1e-6)
