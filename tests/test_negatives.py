"""Tests of the negatives table (negatives/table.py) and the ANCE and BM25 tables
(negatives/strategies/ance.py, bm25.py)."""

from __future__ import annotations

import json
from pathlib import Path

import bm25s
import numpy as np
import pytest
from scipy import stats

from ance_train.config import DataConfig
from ance_train.data.corpus import Corpus
from ance_train.data.dataset import DatasetIndex
from ance_train.data.formats import DatasetFiles
from ance_train.data.validation import validate_dataset
from ance_train.negatives.strategies.ance import ance_negatives
from ance_train.negatives.strategies.bm25 import bm25_index, bm25_negatives, bm25_rank
from ance_train.negatives.table import (
    PAD,
    SOURCE_CODE,
    NegativesTable,
    overlap_at,
    remove_positives,
    uniform_probabilities,
)


def _table(probabilities: np.ndarray | None = None) -> NegativesTable:
    candidates = np.array(
        [[10, 11, 12, 13, 14], [20, PAD, 21, PAD, 22], [PAD] * 5, [30, 31, PAD, PAD, PAD]],
        dtype=np.int64,
    )
    probs = uniform_probabilities(candidates) if probabilities is None else probabilities
    return NegativesTable(
        step=7,
        query_ids=np.array(["qa", "qb", "qc", "qd"]),
        candidates=candidates,
        scores=np.arange(20, dtype=np.float32).reshape(4, 5),
        positive_scores=np.array([1.5, 2.5, 0.0, -1.0], np.float32),
        probabilities=probs,
        sources=np.where(candidates != PAD, SOURCE_CODE["ann"], -1).astype(np.int8),
    )


# --------------------------------------------------------------------------- remove_positives


def test_remove_positives_drops_positives_and_padding_keeping_order() -> None:
    ranked = np.array([[5, 1, 7, 2, 9, 3], [4, PAD, 8, 6, PAD, PAD], [1, 2, 3, 4, 5, 6]])
    scores = np.array([[9, 8, 7, 6, 5, 4], [3, 0, 2, 1, 0, 0], [6, 5, 4, 3, 2, 1]], np.float32)
    positives = [{1, 9}, set(), {1, 2, 3, 4, 5}]
    ids, kept = remove_positives(ranked, scores, positives, keep=3)
    # Row 0 without 1 and 9: 5, 7, 2, (3) -> the first three.
    assert ids.tolist() == [[5, 7, 2], [4, 8, 6], [6, PAD, PAD]]
    assert kept.tolist() == [[9, 7, 6], [3, 2, 1], [1, 0, 0]]
    assert ids.dtype == np.int64 and kept.dtype == np.float32
    for row, pos in zip(ids, positives, strict=True):
        assert not set(row.tolist()) & pos


def test_remove_positives_random_rows_never_return_positives() -> None:
    rng = np.random.default_rng(0)
    ranked = np.stack([rng.permutation(100)[:40] for _ in range(50)])
    scores = -np.sort(-rng.random((50, 40)).astype(np.float32), axis=1)
    positives = [set(rng.choice(100, size=5, replace=False).tolist()) for _ in range(50)]
    ids, kept = remove_positives(ranked, scores, positives, keep=30)
    for row in range(50):
        expected = [d for d in ranked[row].tolist() if d not in positives[row]][:30]
        assert ids[row].tolist() == expected  # at least 35 non-positives: no padding
        assert not set(ids[row].tolist()) & positives[row]
        lookup = dict(zip(ranked[row].tolist(), scores[row].tolist(), strict=True))
        assert kept[row].tolist() == [lookup[d] for d in expected]


# --------------------------------------------------------------------------- probabilities


def test_uniform_probabilities() -> None:
    candidates = np.array([[1, 2, 3, 4], [5, PAD, 6, PAD], [PAD, PAD, PAD, PAD]])
    probs = uniform_probabilities(candidates)
    assert probs.tolist() == [[0.25] * 4, [0.5, 0.0, 0.5, 0.0], [0.0] * 4]
    assert np.allclose(probs[:2].sum(axis=1), 1.0)
    assert np.all(probs[candidates == PAD] == 0)


# --------------------------------------------------------------------------- sampling


def test_sample_never_returns_padding_or_duplicates() -> None:
    table = _table()
    rng = np.random.default_rng(1)
    for _ in range(200):
        for qid, n in (("qa", 3), ("qa", 5), ("qb", 2), ("qb", 3), ("qd", 2)):
            picked = table.sample(qid, n, rng)
            assert len(picked) == n
            assert len(set(picked)) == n
            assert PAD not in picked
            assert set(picked) <= set(table.candidates[table.row(qid)].tolist())
    # Short rows give what they have; empty, unknown and n=0 give nothing.
    assert sorted(table.sample("qb", 10, rng)) == [20, 21, 22]
    assert sorted(table.sample("qd", 3, rng)) == [30, 31]
    assert table.sample("qc", 2, rng) == []
    assert table.sample("unknown", 2, rng) == []
    assert table.sample("qa", 0, rng) == []


def test_sample_frequencies_follow_stored_probabilities() -> None:
    probs = np.zeros((4, 5), np.float32)
    probs[0] = [0.5, 0.25, 0.15, 0.07, 0.03]
    probs[1] = [0.6, 0.0, 0.3, 0.0, 0.1]
    table = _table(probs)
    rng = np.random.default_rng(1234)
    draws = 20_000
    for qid, row in (("qa", 0), ("qb", 1)):
        valid = table.candidates[row] != PAD
        docs = table.candidates[row][valid].tolist()
        expected = probs[row][valid].astype(np.float64)
        expected /= expected.sum()  # float32 storage: sums to 1 only to ~1e-7
        counts = np.zeros(len(docs))
        for _ in range(draws):
            (doc,) = table.sample(qid, 1, rng)
            counts[docs.index(doc)] += 1
        chi2 = stats.chisquare(counts, expected * draws)
        assert chi2.pvalue > 1e-4, (qid, counts.tolist())
        # And each frequency within 5 binomial standard deviations.
        sigma = np.sqrt(draws * expected * (1 - expected))
        assert np.all(np.abs(counts - expected * draws) <= 5 * sigma), (qid, counts.tolist())


def test_sample_without_replacement_covers_row_by_probability() -> None:
    """Drawing 2 of a row: the most probable candidate is picked in most draws."""
    probs = np.zeros((4, 5), np.float32)
    probs[0] = [0.9, 0.025, 0.025, 0.025, 0.025]
    probs[1] = [1 / 3, 0.0, 1 / 3, 0.0, 1 / 3]
    table = _table(probs)
    rng = np.random.default_rng(3)
    hits = sum(10 in table.sample("qa", 2, rng) for _ in range(2000))
    assert hits > 1900  # P(10 in pair) = 0.9 + 0.1 * 0.9 / 0.925 > 0.99


def test_sample_many_draws_each_query_from_its_own_row() -> None:
    table = _table()
    rng = np.random.default_rng(5)
    queries = ["qd", "unknown", "qa", "qc", "qb", "qa"]
    for _ in range(200):
        drawn = table.sample_many(queries, 3, rng)
        assert len(drawn) == len(queries)
        assert sorted(drawn[0]) == [30, 31]  # short row: all it has
        assert drawn[1] == [] and drawn[3] == []  # unknown query, empty row
        for i in (2, 4, 5):
            row = table.candidates[table.row(queries[i])]
            assert len(drawn[i]) == 3 and len(set(drawn[i])) == 3
            assert set(drawn[i]) <= set(row[row != PAD].tolist())
    assert table.sample_many(queries, 0, rng) == [[] for _ in queries]
    assert table.sample_many([], 2, rng) == []


def test_sample_many_pairs_follow_draws_without_replacement() -> None:
    """Two of [0.5, 0.3, 0.2]: P(pair = {a, b}) = p_a p_b / (1 - p_a) + p_b p_a / (1 - p_b)."""
    probs = np.zeros((4, 5), np.float32)
    probs[0, :3] = [0.5, 0.3, 0.2]
    candidates = np.full((4, 5), PAD, np.int64)
    candidates[0, :3] = [1, 2, 3]
    table = NegativesTable(step=1, query_ids=np.array(["qa", "qb", "qc", "qd"]),
                           candidates=candidates, scores=np.zeros((4, 5), np.float32),
                           positive_scores=np.zeros(4, np.float32), probabilities=probs,
                           sources=np.zeros((4, 5), np.int8))
    p = {1: 0.5, 2: 0.3, 3: 0.2}
    pairs = [(1, 2), (1, 3), (2, 3)]
    expected = np.array([p[a] * p[b] / (1 - p[a]) + p[b] * p[a] / (1 - p[b]) for a, b in pairs])
    rng = np.random.default_rng(11)
    draws = 4000
    counts = dict.fromkeys(pairs, 0)
    for _ in range(draws // 4):
        for row in table.sample_many(["qa"] * 4, 2, rng):
            counts[tuple(sorted(row))] += 1
    observed = np.array([counts[pair] for pair in pairs])
    assert stats.chisquare(observed, expected * draws).pvalue > 1e-4, observed.tolist()
    # Negative control: uniform pairs are rejected.
    assert stats.chisquare(observed, np.full(3, draws / 3)).pvalue < 1e-4


# --------------------------------------------------------------------------- serialisation


def test_to_bytes_round_trip() -> None:
    table = _table()
    copy = NegativesTable.from_bytes(table.to_bytes())
    assert copy.step == 7
    assert copy.query_ids.tolist() == ["qa", "qb", "qc", "qd"]
    for name in ("candidates", "scores", "positive_scores", "probabilities", "sources"):
        original, restored = getattr(table, name), getattr(copy, name)
        assert restored.dtype == original.dtype, name
        assert np.array_equal(restored, original), name
    assert len(copy) == 4
    assert copy.row("qb") == 1 and copy.row("nope") is None
    rng_a, rng_b = np.random.default_rng(9), np.random.default_rng(9)
    assert [table.sample("qa", 3, rng_a) for _ in range(5)] == [
        copy.sample("qa", 3, rng_b) for _ in range(5)
    ]


# --------------------------------------------------------------------------- ANCE mining


def test_ance_negatives_from_ranked_matrix() -> None:
    ranked = np.array([[3, 0, 4, 1, 5, PAD], [2, 6, 7, 8, 9, 1]], dtype=np.int64)
    scores = np.array([[6, 5, 4, 3, 2, 0], [9, 8, 7, 6, 5, 4]], np.float32)
    positives = [{0, 1}, {2, 7}]
    table = ance_negatives(12, ["qx", "qy"], ranked, scores, positives,
                           np.array([5.0, 9.0]), top_k=4)
    assert table.step == 12
    assert table.query_ids.tolist() == ["qx", "qy"]
    assert table.candidates.tolist() == [[3, 4, 5, PAD], [6, 8, 9, 1]]
    assert table.scores.tolist() == [[6, 4, 2, 0], [8, 6, 5, 4]]
    assert table.positive_scores.dtype == np.float32
    assert table.positive_scores.tolist() == [5.0, 9.0]
    for row, pos in zip(table.candidates, positives, strict=True):
        assert not set(row.tolist()) & pos
    valid = table.candidates != PAD
    assert np.all(table.sources[valid] == SOURCE_CODE["ann"])
    assert np.allclose(table.probabilities[0], [1 / 3, 1 / 3, 1 / 3, 0])
    assert np.allclose(table.probabilities[1], [0.25] * 4)


def test_overlap_at_hand_example() -> None:
    candidates = np.array([[1, 2, 3, PAD], [4, 5, PAD, PAD]])
    top = np.array([[2, 3, 9, PAD], [PAD, 7, 8, 6]])
    # Row 0: 2 of 3 candidates in top; row 1: 0 of 2 -> 2 / 5.
    assert overlap_at(candidates, top) == pytest.approx(0.4)
    assert overlap_at(np.full((2, 3), PAD), top[:, :3]) == 0.0


# --------------------------------------------------------------------------- BM25 warm-up


def _own_texts(dataset_dir: Path) -> list[str]:
    """Document texts read straight from corpus.jsonl: title and text joined by a space."""
    texts = []
    with open(dataset_dir / "corpus.jsonl", encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                doc = json.loads(line)
                parts = [p.strip() for p in (doc.get("title") or "", doc["text"]) if p.strip()]
                texts.append(" ".join(parts))
    return texts


def _bm25_scores(texts: list[str], queries: list[str]) -> np.ndarray:
    """Full ``[queries, docs]`` BM25 score matrix from bm25s, query by query."""
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(texts, stopwords="en", show_progress=False),
                    show_progress=False)
    tokens = bm25s.tokenize(queries, stopwords="en", return_ids=False, show_progress=False)
    matrix = np.zeros((len(queries), len(texts)), np.float32)
    for row, query in enumerate(tokens):
        known = [t for t in query if t in retriever.vocab_dict]
        if known:
            matrix[row] = retriever.get_scores(known)
    return matrix


def test_bm25_negatives_match_bm25s_ranking(scifact_subset: Path, tmp_path: Path) -> None:
    cfg = DataConfig(path=str(scifact_subset), dev_fraction=0.0)
    dataset: DatasetIndex = validate_dataset(cfg, tmp_path / "cache", seed=0)
    corpus = Corpus(DatasetFiles.resolve(cfg), tmp_path / "cache" / "doc_offsets.npy", "beir")
    query_ids = sorted(dataset.train)
    assert len(query_ids) >= 30
    top_k = 10
    table = bm25_negatives(corpus, dataset, query_ids, top_k)

    texts = _own_texts(scifact_subset)
    assert len(texts) == len(corpus) == 300
    scores = _bm25_scores(texts, [dataset.queries[q] for q in query_ids])
    assert table.step == -1
    assert table.query_ids.tolist() == query_ids
    assert table.candidates.shape == (len(query_ids), top_k)
    matched_exactly = 0
    for row, qid in enumerate(query_ids):
        positives = set(dataset.train[qid])
        got = table.candidates[row].tolist()
        assert PAD not in got
        assert len(set(got)) == top_k
        assert not set(got) & positives, qid
        assert np.all(table.sources[row] == SOURCE_CODE["bm25"])
        assert np.allclose(table.probabilities[row], 1 / top_k)
        # bm25s' own ranking without the positives, computed here independently.
        order = np.argsort(-scores[row], kind="stable")
        expected = [int(d) for d in order if int(d) not in positives][:top_k]
        expected_scores = scores[row][expected]
        # Same scores rank by rank, and each returned document has the score it claims.
        assert np.allclose(table.scores[row], expected_scores, rtol=1e-5, atol=1e-5), qid
        assert np.allclose(scores[row][got], table.scores[row], rtol=1e-5, atol=1e-5), qid
        # Where scores are untied the documents themselves must agree.
        for rank, doc in enumerate(expected):
            tied = np.isclose(scores[row], scores[row][doc], rtol=1e-6, atol=1e-6).sum() > 1
            if not tied:
                assert got[rank] == doc, (qid, rank)
        matched_exactly += got == expected
    assert matched_exactly >= len(query_ids) // 2
    corpus.close()


def test_bm25_top_k_never_selects_jax(monkeypatch: pytest.MonkeyPatch) -> None:
    """bm25s's ``backend_selection="auto"`` uses JAX whenever it is installed, and JAX then
    takes 75 % of a GPU's memory (seen starving the trainer on an H200). JAX is not installed
    here, so this unit test watches the argument the real ``retrieve`` receives instead."""
    seen: list[str] = []
    retrieve = bm25s.BM25.retrieve

    def watched(self, *args, **kwargs):
        seen.append(kwargs.get("backend_selection", "auto"))
        return retrieve(self, *args, **kwargs)

    monkeypatch.setattr(bm25s.BM25, "retrieve", watched)
    texts = ["aspirin lowers fever", "insulin regulates glucose", "fever in children"]
    ranked, scores = bm25_rank(bm25_index(texts), ["fever", "glucose insulin"], depth=2)
    assert seen == ["numpy"]
    assert ranked.shape == scores.shape == (2, 2)
    assert ranked[1, 0] == 1 and set(ranked[0].tolist()) == {0, 2}
    assert np.all(np.diff(scores, axis=1) <= 0)  # best first
