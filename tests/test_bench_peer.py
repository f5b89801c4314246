"""The sentence-transformers peer (``bench/quality.py --methods st-static``) on a tiny model:
the same split and checkpoints as the system's runs, evaluated and rebuilt by the same code."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np

from ance_train.config import DataConfig
from ance_train.data.dataset import DatasetIndex
from ance_train.data.validation import validate_dataset

from ance_train_dev.helpers import REPO


def test_peer_runs_as_a_quality_method(monkeypatch, tmp_path: Path, scifact_subset,
                                       tiny_model) -> None:
    """In process (the interpreter and imports are most of a subprocess's time here)."""
    from ance_train_dev import quality, significance

    out, runs = tmp_path / "out", tmp_path / "runs"
    sigterm = signal.getsignal(signal.SIGTERM)  # quality.main installs its own
    try:
        assert quality.main(
            ["--profile", "cpu", "--methods", "st-static", "--seeds", "7",
             "--data", str(scifact_subset), "--model", str(tiny_model), "--steps", "4",
             "--refresh-every", "2", "--max-doc-length", "32",
             "--set", "training.learning_rate=1e-3", "--runs-dir", str(runs),
             "--out", str(out)]) == 0
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    report = json.loads((out / "quality-cpu.json").read_text())
    (run,) = report["runs"]
    assert run["method"] == "st-static"
    assert [r["step"] for r in run["refreshes"]] == [0, 2, 4]  # the system's checkpoints
    assert len(run["losses"]) == 4 and all(np.isfinite(run["losses"]))
    assert 0 < run["peer"]["triplets"] <= run["peer"]["pairs"]  # a pair may find no negative
    # The split is the system's: validate_dataset with the same config and split seed.
    store = runs / "st-static-s7" / "store" / "st-static-s7"
    stored = DatasetIndex.from_json((store / "data" / "dataset.json").read_text())
    expected = validate_dataset(DataConfig(path=str(scifact_subset)), tmp_path / "cache")
    assert (stored.train, stored.dev, stored.test) == (expected.train, expected.dev,
                                                       expected.test)
    # Training changed the model: checkpoint 4's corpus embeddings are not checkpoint 0's.
    first, last = (np.load(store / "embeddings" / str(s) / "corpus-00000.npz")["vectors"]
                   for s in (0, 4))
    assert first.shape == last.shape and not np.allclose(first, last)
    assert "st-static" in (out / "quality-cpu.md").read_text()

    # Every other system against the peer, from the embeddings it stored (the rebuilt test
    # nDCG@10 must reproduce the reported one, or significance.py stops).
    assert significance.main(
        [str(out / "quality-cpu.json"), "--runs-dir", str(runs), "--out", str(out),
         "--reference", "st-static", "--name", "vs-peer"]) == 0
    sig = json.loads((out / "vs-peer.json").read_text())
    assert [(c["method"], c["versus"]) for c in sig["comparisons"]] == [
        ("zero-shot", "st-static"), ("BM25", "st-static")]
    assert all(0.0 < c["p"] <= c["p_bh"] <= 1.0 for c in sig["comparisons"])


def test_peer_truncates_queries_and_documents_separately(monkeypatch, tiny_model) -> None:
    """The anchor column gets the query limit, the others the document limit."""
    from sentence_transformers import SentenceTransformer

    from ance_train_dev.peer_sentence_transformers import _collator

    model = SentenceTransformer(str(tiny_model), device="cpu")
    long = " ".join(["word"] * 200)
    batch = _collator(model, {"anchor": 8, "positive": 20, "negative": 20})(
        [{"anchor": long, "positive": long, "negative": "short"}] * 2)
    assert batch["anchor_input_ids"].shape == (2, 8)
    assert batch["positive_input_ids"].shape == (2, 20)
    assert batch["negative_input_ids"].shape[1] < 20


def test_peer_shares_the_methods_budget_and_named_datasets(monkeypatch, tmp_path: Path) -> None:
    """The peer's config is ance's data/model/training/inference with the profile laid over
    it; ``--data nfcorpus`` is the shared NFCorpus copy, reported under its own name."""
    from ance_train_dev import quality

    args = quality.parse_args(["--data", "nfcorpus", "--steps", "60"])
    assert args.data == REPO.parent / "shared" / "data" / "nfcorpus"
    assert quality.default_name(args) == "quality-cpu-nfcorpus"
    peer = quality.method_config("st-static", 13, args, tmp_path)
    ance = quality.method_config("ance", 13, args, tmp_path)
    for section in ("data", "model", "training", "inference"):
        assert peer[section] == ance[section], section
    assert peer["training"]["steps"] == 60 and peer["run_id"] == "st-static-s13"
    scifact = quality.parse_args(["--data", str(tmp_path / "some-beir-dir")])
    assert quality.default_name(scifact) == "quality-cpu"  # a directory keeps the old name
