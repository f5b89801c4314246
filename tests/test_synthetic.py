"""Synthetic inputs (dev/ance_train_dev/synthetic.py): a valid BEIR dataset and clustered
embeddings whose nearest neighbours are structured."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ance_train.config import DataConfig
from ance_train.data.validation import validate_dataset

from ance_train_dev.synthetic import clustered_vectors, queries_near, write_beir


def test_written_beir_dataset_validates(tmp_path: Path) -> None:
    write_beir(tmp_path / "data", num_docs=500, num_train=40, num_test=10, seed=3)
    index = validate_dataset(DataConfig(path=str(tmp_path / "data"), dev_fraction=0.0),
                             tmp_path / "cache")
    assert index.num_docs == 500 and not index.warnings
    assert (len(index.train), len(index.test)) == (40, 10)
    # Each query is the first six words of its single positive document.
    docs = [json.loads(line) for line in (tmp_path / "data/corpus.jsonl").open()]
    queries = {json.loads(line)["_id"]: json.loads(line)["text"]
               for line in (tmp_path / "data/queries.jsonl").open()}
    for qid, positives in index.train.items():
        (doc,) = positives
        assert docs[doc]["text"].startswith(queries[qid])


def test_clustered_vectors_are_normalised_and_queries_find_their_anchor() -> None:
    rng = np.random.default_rng(0)
    vectors = clustered_vectors(2000, 16, clusters=20, rng=rng)
    assert vectors.shape == (2000, 16) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    queries, anchors = queries_near(vectors, 50, rng)
    nearest = np.argmax(queries @ vectors.T, axis=1)
    assert (nearest == anchors).mean() > 0.9
    # Clustered: a point's nearest other point is much closer than a random point.
    sims = vectors[:100] @ vectors.T
    np.fill_diagonal(sims[:, :100], -1)
    assert sims.max(axis=1).mean() > 0.5 > float(np.abs(sims[:, 1000:]).mean())
