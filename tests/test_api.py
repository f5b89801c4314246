"""The Python API (``from ance_train import Run``): a tiny embedded run driven from Python,
its refreshes iterated as they arrive, the best checkpoint exported. Real services as OS
processes, real Redis, local store."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import ance_train
from ance_train.config import MIN_DEV_QUERIES
from ance_train.launcher.embedded import RunAborted

from ance_train_dev.helpers import assert_export_loads_like

pytestmark = pytest.mark.e2e

STEPS, EVERY = 6, 3


def _config(root: Path, tiny_model: Path, scifact_subset: Path, **training) -> dict:
    return {
        "run_id": "api", "output_dir": str(root / "runs"),
        "data": {"path": str(scifact_subset), "dev_fraction": 0.2},
        "model": {"path": str(tiny_model), "max_query_length": 32, "max_doc_length": 64},
        "training": {"steps": STEPS, "batch_size": 8, "refresh_every": EVERY,
                     "warmup_steps": 1, "torch_threads": 1, **training},
        "negatives": {"pool": "ann", "warmup": "bm25", "top_k": 20},
        "inference": {"replicas": 1, "shard_size": 100, "batch_size": 16, "torch_threads": 1},
        "index": {"eval_depth": 50},
    }


def test_run_from_a_dict_iterates_refreshes_and_exports_the_best(tmp_path: Path, tiny_model,
                                                                 scifact_subset) -> None:
    run = ance_train.Run(_config(tmp_path, tiny_model, scifact_subset), max_minutes=6)
    seen = []
    with run:
        for refresh in run.refreshes():
            seen.append(refresh)
            assert set(refresh.metrics) == {"dev", "test"}
            assert 0.0 <= refresh.metrics["dev"]["ndcg@10"] <= 1.0
    steps = [r.step for r in seen]
    assert steps[0] == 0 and steps[-1] == STEPS, steps
    assert steps == sorted(steps) and set(steps) <= {0, 3, 6}
    assert run.evaluations == seen
    assert run.trainer_summary["finished"] and run.trainer_summary["steps"] == STEPS
    # The same summary the CLI writes, and the same evaluation reports the indexer stored.
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert [e["step"] for e in summary["evaluations"]] == steps
    store = run.run_dir / "store" / "api"
    for refresh in seen:
        report = json.loads((store / "eval" / f"{refresh.step}.json").read_text())
        assert report["metrics"] == refresh.metrics

    # best (protocol/selection.py): this subset's dev split is under MIN_DEV_QUERIES, so the
    # latest checkpoint whose dev value reaches the lower end of the highest one's interval.
    dev_queries = len(json.loads((store / "data" / "dataset.json").read_text())["dev"])
    assert 0 < dev_queries < MIN_DEV_QUERIES
    top = max(seen, key=lambda r: (r.metrics["dev"]["ndcg@10"], -r.step))
    floor = json.loads((store / "eval" / f"{top.step}.json").read_text())["ci95"]["dev"][
        "ndcg@10"][0]
    best = max(r.step for r in seen if r.metrics["dev"]["ndcg@10"] >= floor)
    exported = run.export("best")
    card = (exported / "README.md").read_text()
    assert f"checkpoint of step {best}" in card, card[:800]
    assert_export_loads_like(exported, store / "checkpoints" / str(best), run.config.model)
    # Iterating again after the end replays the evaluations; the services are gone.
    assert [r.step for r in run.refreshes()] == steps
    assert all(child.process.poll() is not None for child in run._run.children)


def test_a_bad_config_fails_before_anything_starts(tmp_path: Path, tiny_model,
                                                   scifact_subset) -> None:
    config = _config(tmp_path, tiny_model, scifact_subset)
    config["training"]["stpes"] = 3
    with pytest.raises(ValueError, match=r"training\.stpes"):
        ance_train.Run(config)
    assert not (tmp_path / "runs").exists()


def test_a_service_that_dies_stops_the_iteration(tmp_path: Path, tiny_model,
                                                 scifact_subset) -> None:
    """With services.restart.policy never (the default restarts it: tests/test_restarts.py),
    and every service started cold (services.warm_start off: a fresh interpreter each, no
    zygote)."""
    config = _config(tmp_path, tiny_model, scifact_subset)
    config["services"] = {"restart": {"policy": "never"}, "warm_start": False}
    run = ance_train.Run(config, max_minutes=6).start()
    assert run._run.warm is None
    assert all(isinstance(c.process, subprocess.Popen) for c in run._run.children)
    indexer = next(c for c in run._run.children if c.role == "indexer")
    indexer.process.kill()
    with pytest.raises(RunAborted, match=r"indexer exited with signal SIGKILL and is not "
                                         r"restarted: services\.restart\.policy is never"):
        for _ in run.refreshes():
            pass
    assert all(child.process.poll() is not None for child in run._run.children)
