"""Tests of the FAISS inner-product index (src/ance_train/index/ann.py) against brute force."""

from __future__ import annotations

import numpy as np
import pytest

from ance_train.index.ann import AnnIndex
from ance_train.protocol.supersession import Superseded

DIM = 16


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two shards of documents with non-contiguous ids, and some queries."""
    rng = np.random.default_rng(seed)
    ids = rng.choice(10_000, size=120, replace=False).astype(np.int64)
    vectors = rng.standard_normal((120, DIM)).astype(np.float32)
    queries = rng.standard_normal((37, DIM)).astype(np.float32)
    return ids, vectors, queries


def _index(ids: np.ndarray, vectors: np.ndarray) -> AnnIndex:
    index = AnnIndex(DIM)
    index.add(ids[:70], vectors[:70])
    index.add(ids[70:], vectors[70:])
    index.finalize()
    return index


def _brute_force(ids: np.ndarray, vectors: np.ndarray, queries: np.ndarray,
                 k: int) -> tuple[np.ndarray, np.ndarray]:
    scores = queries.astype(np.float64) @ vectors.astype(np.float64).T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return ids[order], np.take_along_axis(scores, order, axis=1)


def test_search_equals_brute_force() -> None:
    ids, vectors, queries = _data()
    index = _index(ids, vectors)
    assert len(index) == 120
    got_ids, got_scores = index.search(queries, k=10)
    want_ids, want_scores = _brute_force(ids, vectors, queries, 10)
    assert got_ids.shape == (37, 10) and got_ids.dtype == np.int64
    assert got_scores.dtype == np.float32
    # Random Gaussian vectors: ties are (almost surely) absent, so the order must match.
    assert np.array_equal(got_ids, want_ids)
    assert np.allclose(got_scores, want_scores, atol=1e-4)
    # The returned ids are the caller's ids, never FAISS row numbers.
    assert set(got_ids.ravel().tolist()) <= set(ids.tolist())


def test_batch_size_smaller_than_queries_gives_same_results() -> None:
    ids, vectors, queries = _data(1)
    index = _index(ids, vectors)
    full_ids, full_scores = index.search(queries, k=7, batch_size=1024)
    for batch_size in (1, 5, 36):
        ids_b, scores_b = index.search(queries, k=7, batch_size=batch_size)
        assert np.array_equal(ids_b, full_ids), batch_size
        assert np.allclose(scores_b, full_scores, atol=1e-6), batch_size


def test_k_larger_than_index_is_clipped() -> None:
    ids, vectors, queries = _data(2)
    index = AnnIndex(DIM)
    index.add(ids[:5], vectors[:5])
    index.add(ids[5:8], vectors[5:8])
    index.finalize()
    got_ids, got_scores = index.search(queries[:4], k=50)
    assert got_ids.shape == (4, 8)
    want_ids, want_scores = _brute_force(ids[:8], vectors[:8], queries[:4], 8)
    assert np.array_equal(got_ids, want_ids)
    assert np.allclose(got_scores, want_scores, atol=1e-4)
    assert not np.any(got_ids == -1)
    for row in got_ids:
        assert sorted(row.tolist()) == sorted(ids[:8].tolist())


def test_dimension_mismatch_raises() -> None:
    index = AnnIndex(DIM)
    with pytest.raises(ValueError, match="dimension"):
        index.add(np.arange(3), np.zeros((3, DIM + 1), np.float32))
    assert len(index) == 0


def test_cancel_hook_abandons_the_search_between_batches() -> None:
    ids, vectors, queries = _data(3)
    index = _index(ids, vectors)
    calls = []

    def cancel() -> None:
        calls.append(len(calls))
        if len(calls) == 2:  # let the first batch through, abandon before the second
            raise Superseded(0)

    with pytest.raises(Superseded):
        index.search(queries, k=3, batch_size=4, cancel=cancel)
    assert calls == [0, 1]
