"""`ance-train export` against a local store holding checkpoints and eval reports written the
way the trainer and indexer write them (the S3 backend and a real run: tests/test_e2e.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ance_train.config import MIN_DEV_QUERIES, parse_config
from ance_train.data.dataset import DatasetIndex
from ance_train.infra.store import LocalStore
from ance_train.modeling.export import ExportError, export_checkpoint, select_checkpoint
from ance_train.modeling.model import BiEncoder, load_tokenizer
from ance_train.protocol import keys
from ance_train.protocol.selection import DevPoint, select_on_dev
from ance_train.trainer.training_state import STATE_JSON

from ance_train_dev.helpers import assert_export_loads_like, card_metrics, model_card_metadata

# dev nDCG@10 peaks at step 5; test peaks at step 10 (best must not look at test).
REPORTS = {0: {"dev": {"ndcg@10": 0.10, "mrr@10": 0.08}, "test": {"ndcg@10": 0.11}},
           5: {"dev": {"ndcg@10": 0.30, "mrr@10": 0.25}, "test": {"ndcg@10": 0.20}},
           10: {"dev": {"ndcg@10": 0.25, "mrr@10": 0.22}, "test": {"ndcg@10": 0.40}}}


@pytest.fixture
def run_store(tmp_path, tiny_model):
    config = parse_config({"run_id": "exp", "data": {"path": str(tmp_path / "scifact")},
                           "model": {"path": str(tiny_model), "similarity": "cosine"}})
    store = LocalStore("exp", tmp_path / "store")
    model = BiEncoder.from_pretrained(tiny_model, config.model)
    tokenizer = load_tokenizer(tiny_model)
    for step, metrics in REPORTS.items():
        with torch.no_grad():  # a different model per checkpoint
            next(model.encoder.parameters()).add_(0.01 * step)
        directory = tmp_path / "local" / str(step)
        model.save(directory, tokenizer)
        (directory / STATE_JSON).write_text("{}")  # the resume state: never exported
        store.put_dir(keys.checkpoint(step), directory)
        store.put_json(keys.eval_report(step), {"step": step, "metrics": metrics,
                                                "timings": {}, "diagnostics": {}})
    store.put_bytes(keys.RUN_CONFIG, yaml.safe_dump(config.model_dump(mode="json")).encode())
    return store, config, tmp_path


def test_best_is_dev_best_and_the_export_loads_with_both_libraries(run_store) -> None:
    store, config, tmp_path = run_store
    assert select_checkpoint(store, "best") == 5
    assert select_checkpoint(store, "last") == 10
    step, out = export_checkpoint(store, "best", tmp_path / "out")
    assert step == 5
    assert not (out / STATE_JSON).exists() and not (out / "MANIFEST.json").exists()
    assert_export_loads_like(out, tmp_path / "local" / "5", config.model)
    metadata = model_card_metadata(out)
    assert metadata["library_name"] == "sentence-transformers"
    assert metadata["pipeline_tag"] == "sentence-similarity"
    assert metadata["base_model"] == Path(config.model.path).name
    assert metadata["datasets"] == ["BeIR/scifact"]
    assert card_metrics(metadata) == {
        "dev": {"ndcg_at_10": 0.30, "mrr_at_10": 0.25}, "test": {"ndcg_at_10": 0.20}}
    card = (out / "README.md").read_text()
    assert "arXiv:2007.00808" in card and "never on test" in card
    assert (out / "ance_train_config.yaml").is_file()


def test_unknown_step_names_the_step_and_the_run(run_store) -> None:
    store, _, tmp_path = run_store
    with pytest.raises(ExportError, match=r"run 'exp' has no complete checkpoint 7; its "
                                          r"checkpoints: 0, 5, 10"):
        export_checkpoint(store, "7", tmp_path / "out")
    with pytest.raises(ExportError, match="best, last or a step number"):
        select_checkpoint(store, "first")


def test_best_without_dev_metrics_is_an_error(run_store) -> None:
    store, _, _ = run_store
    for step in REPORTS:
        store.put_json(keys.eval_report(step), {"step": step, "metrics": {
            "test": {"ndcg@10": 0.5}}, "timings": {}, "diagnostics": {}})
    with pytest.raises(ExportError, match=r"run 'exp': no checkpoint has dev ndcg@10"):
        select_checkpoint(store, "best")
    assert select_checkpoint(store, "last") == 10


def test_cli_exports_by_run_id_and_refuses_a_non_empty_out(run_store) -> None:
    _, _, tmp_path = run_store
    out = tmp_path / "cli-out"
    command = [sys.executable, "-m", "ance_train.cli", "export", "--run", "exp",
               "--store-dir", str(tmp_path / "store"), "--checkpoint", "last", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "exported checkpoint 10 of run exp" in done.stdout
    assert card_metrics(model_card_metadata(out))["test"] == {"ndcg_at_10": 0.40}
    again = subprocess.run(command, capture_output=True, text=True)
    assert again.returncode == 1 and "already exists and is not empty" in again.stderr
    missing = subprocess.run([*command[:-4], "--checkpoint", "3", "--out", str(tmp_path / "x")],
                             capture_output=True, text=True)
    assert missing.returncode == 1 and "no complete checkpoint 3" in missing.stderr


def test_unevaluated_checkpoint_has_no_model_index_and_a_head_is_refused(run_store,
                                                                         tiny_model) -> None:
    store, config, tmp_path = run_store
    model = BiEncoder.from_pretrained(tiny_model, config.model)
    model.save(tmp_path / "local" / "12", load_tokenizer(tiny_model))
    store.put_dir(keys.checkpoint(12), tmp_path / "local" / "12")
    step, out = export_checkpoint(store, "12", tmp_path / "unevaluated")
    assert step == 12 and "model-index" not in model_card_metadata(out)
    assert "Checkpoint 12 has no evaluation report." in (out / "README.md").read_text()
    headed = BiEncoder.from_pretrained(tiny_model, config.model.model_copy(
        update={"projection_dim": 16}))
    headed.save(tmp_path / "local" / "15", load_tokenizer(tiny_model))
    store.put_dir(keys.checkpoint(15), tmp_path / "local" / "15")
    with pytest.raises(ExportError, match=r"checkpoint 15 of run 'exp' has ANCE's projection"):
        export_checkpoint(store, "last", tmp_path / "headed")
    assert not (tmp_path / "headed").exists()


def test_model_card_names_where_dev_came_from() -> None:
    """data.dev_split decides what the card says the dev split is."""
    from ance_train.config import RunConfig
    from ance_train.modeling.export import _dev_source

    assert _dev_source(RunConfig(data={"path": "/d", "dev_split": "train"})).startswith(
        "a held-out slice of the training queries (10%, at most 200, split seed 42)")
    assert _dev_source(RunConfig(data={"path": "/d", "dev_qrels": "dev2.tsv"})) == \
        "the dev qrels (dev2.tsv)"
    auto = _dev_source(RunConfig(data={"path": "/d"}))
    assert "qrels/dev.tsv" in auto and "held-out slice" in auto


def _with_dev_split(store: LocalStore, queries: int, interval: tuple[float, float]) -> None:
    """The run's dataset index with a dev split of ``queries`` queries, and the best (step 5)
    report's dev interval."""
    index = DatasetIndex(format="beir", num_docs=3, dev={f"q{i}": {0: 1} for i in range(queries)})
    store.put_bytes(keys.DATASET_INDEX, index.to_json().encode())
    report = store.get_json(keys.eval_report(5))
    store.put_json(keys.eval_report(5), {**report, "ci95": {"dev": {"ndcg@10": interval}}})


def test_best_with_a_tiny_dev_split_is_the_latest_within_its_noise(run_store) -> None:
    """protocol/selection.py: below MIN_DEV_QUERIES dev queries, step 10 (0.25) is within the
    best's interval (step 5: 0.30, [0.20, 0.40]) and is the later one; with enough queries,
    or a narrower interval, the highest dev value is."""
    store, _, _ = run_store
    _with_dev_split(store, MIN_DEV_QUERIES - 1, (0.20, 0.40))
    assert select_checkpoint(store, "best") == 10
    _with_dev_split(store, MIN_DEV_QUERIES - 1, (0.27, 0.33))
    assert select_checkpoint(store, "best") == 5
    _with_dev_split(store, MIN_DEV_QUERIES, (0.20, 0.40))
    assert select_checkpoint(store, "best") == 5


def test_selection_rules_on_dev_points() -> None:
    points = [DevPoint(0, 0.2), DevPoint(10, 0.41), DevPoint(20, 0.45, (0.40, 0.50)),
              DevPoint(30, 0.43), DevPoint(40, 0.39)]
    assert select_on_dev(points, dev_queries=None) == 20
    assert select_on_dev(points, dev_queries=MIN_DEV_QUERIES) == 20
    assert select_on_dev(points, dev_queries=15) == 30  # 40 is below the interval
    assert select_on_dev([DevPoint(0, 0.2), DevPoint(5, 0.3)], dev_queries=15) == 5  # none
    with pytest.raises(ValueError, match="no evaluated checkpoint"):
        select_on_dev([], dev_queries=15)
