"""The sentence-transformers peer (``bench/quality.py --methods st-static``) on a tiny model:
the same split and checkpoints as the system's runs, evaluated and rebuilt by the same code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from ance_train.config import DataConfig
from ance_train.data.dataset import DatasetIndex
from ance_train.data.validation import validate_dataset

from helpers import REPO


def test_peer_runs_as_a_quality_method(tmp_path: Path, scifact_subset, tiny_model) -> None:
    out, runs = tmp_path / "out", tmp_path / "runs"
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "quality.py"), "--profile", "cpu",
         "--methods", "st-static", "--seeds", "7", "--data", str(scifact_subset),
         "--model", str(tiny_model), "--steps", "4", "--refresh-every", "2",
         "--max-doc-length", "32", "--set", "training.learning_rate=1e-3",
         "--runs-dir", str(runs), "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / f"quality-cpu-{scifact_subset.name}.json").read_text())
    (run,) = report["runs"]
    assert run["method"] == "st-static"
    assert [r["step"] for r in run["refreshes"]] == [0, 2, 4]  # the system's checkpoints
    assert len(run["losses"]) == 4 and all(np.isfinite(run["losses"]))
    assert run["peer"]["triplets"] == run["peer"]["pairs"] > 0
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
    assert "st-static" in (out / f"quality-cpu-{scifact_subset.name}.md").read_text()

    # Every other system against the peer, from the embeddings it stored (the rebuilt test
    # nDCG@10 must reproduce the reported one, or significance.py stops).
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "significance.py"),
         str(out / f"quality-cpu-{scifact_subset.name}.json"), "--runs-dir", str(runs),
         "--out", str(out), "--reference", "st-static", "--name", "vs-peer"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sig = json.loads((out / "vs-peer.json").read_text())
    assert [(c["method"], c["versus"]) for c in sig["comparisons"]] == [
        ("zero-shot", "st-static"), ("BM25", "st-static")]
    assert all(0.0 < c["p"] <= c["p_bh"] <= 1.0 for c in sig["comparisons"])


def test_peer_truncates_queries_and_documents_separately(tiny_model) -> None:
    """The anchor column gets the query limit, the others the document limit."""
    sys.path.insert(0, str(REPO / "bench"))
    from peer_sentence_transformers import _collator
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(tiny_model), device="cpu")
    long = " ".join(["word"] * 200)
    batch = _collator(model, {"anchor": 8, "positive": 20, "negative": 20})(
        [{"anchor": long, "positive": long, "negative": "short"}] * 2)
    assert batch["anchor_input_ids"].shape == (2, 8)
    assert batch["positive_input_ids"].shape == (2, 20)
    assert batch["negative_input_ids"].shape[1] < 20
