"""The strategies' formulas checked against values computed independently in the tests.

SimANS (002 §4.1 Eq. 4), ANCE (000 §4-5), ANCE-Tele (004 §4 Eq. 4-8), DANCE (001 §3.2-3.3
Eq. 6-12), the DPR-style baselines and the per-refresh diagnostics. Every expected value is
written out by hand or with a direct formula here (brute-force numpy search instead of FAISS,
Python ``math`` instead of torch for the losses), never by calling the code under test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats
from torch.nn import functional

from ance_train.config import NegativesConfig
from ance_train.data.dataset import DatasetIndex
from ance_train.index.ann import AnnIndex
from ance_train.indexer.diagnostics import Diagnostics, reciprocal_ranks
from ance_train.negatives.mining import Miner, drop_near_positive, first_seen
from ance_train.negatives.strategies.bm25_random import MixedNegatives
from ance_train.negatives.strategies.dance import dual_query_negatives, mine_dual
from ance_train.negatives.strategies.random import RandomNegatives
from ance_train.negatives.strategies.simans import simans_probabilities
from ance_train.negatives.strategies.tele import mix_rows
from ance_train.negatives.table import (
    PAD,
    SOURCE_CODE,
    NegativesTable,
    source_counts,
    uniform_probabilities,
)
from ance_train.protocol.tables import TableId
from ance_train.trainer.batches import BatchBuilder
from ance_train.trainer.loss import contrastive_nll, layer_grad_norms
from ance_train.trainer.negative_sources import NegativesPicker

ANN, BM25, MOMENTUM, LOOKAHEAD = (SOURCE_CODE[name] for name in
                                  ("ann", "bm25", "momentum", "lookahead"))


# --------------------------------------------------------------------------- helpers


def _table(step: int, rows: dict[str, list[int]],
           probabilities: dict[str, list[float]] | None = None,
           first: dict[str, list[int]] | None = None, source: int = ANN) -> NegativesTable:
    """A table from hand-written rows (padded with PAD to the widest row)."""
    qids = list(rows)
    width = max(len(r) for r in rows.values())
    candidates = np.full((len(qids), width), PAD, dtype=np.int64)
    for i, q in enumerate(qids):
        candidates[i, : len(rows[q])] = rows[q]
    if probabilities is None:
        probs = uniform_probabilities(candidates)
    else:
        probs = np.zeros(candidates.shape, np.float32)
        for i, q in enumerate(qids):
            probs[i, : len(probabilities[q])] = probabilities[q]
    seen = None
    if first is not None:
        seen = np.full(candidates.shape, PAD, dtype=np.int64)
        for i, q in enumerate(qids):
            seen[i, : len(first[q])] = first[q]
    return NegativesTable(
        step=step, query_ids=np.array(qids), candidates=candidates,
        scores=np.zeros(candidates.shape, np.float32),
        positive_scores=np.zeros(len(qids), np.float32), probabilities=probs,
        sources=np.where(candidates != PAD, source, -1).astype(np.int8), first_seen=seen)


def _row(table: NegativesTable, qid: str, field: str = "probabilities") -> dict[int, float]:
    """``{candidate: value}`` of one row, padding left out."""
    row = table.row(qid)
    assert row is not None
    values = getattr(table, field)[row]
    return {int(d): float(v) for d, v in zip(table.candidates[row], values, strict=True)
            if d != PAD}


def _brute_top(vector: np.ndarray, docs: np.ndarray, exclude: set[int], k: int) -> list[int]:
    """The ``k`` documents of highest inner product with ``vector``, ``exclude`` left out."""
    sims = docs.astype(np.float64) @ vector.astype(np.float64)
    order = sorted(range(len(docs)), key=lambda d: -sims[d])
    return [d for d in order if d not in exclude][:k]


@dataclass
class World:
    docs: np.ndarray        # [D, dim] document embeddings (document index = row)
    queries: np.ndarray     # [Q, dim] training-query embeddings in ``train_ids`` order
    train_ids: list[str]    # sorted, as the indexer orders them
    positives: list[set[int]]
    dataset: DatasetIndex
    index: AnnIndex


def _world(num_queries: int, seed: int, multi_positive: bool = True, num_docs: int = 50,
           dim: int = 16) -> World:
    """Random embeddings in a real FAISS index; each query's positives are among its nearest
    documents (ranks 0 and 2, plus a random one for every third query) so that removing them
    from the top-K matters."""
    rng = np.random.default_rng(seed)
    docs = rng.normal(size=(num_docs, dim)).astype(np.float32)
    qids = [f"q{i}" for i in range(num_queries)]  # "q10" sorts before "q2": order matters
    raw = {q: rng.normal(size=dim).astype(np.float32) for q in qids}
    train: dict[str, dict[int, int]] = {}
    for i, q in enumerate(qids):
        near = _brute_top(raw[q], docs, set(), 3)
        pos = {near[0], near[2]} if multi_positive else {near[0]}
        if multi_positive and i % 3 == 0:
            pos.add(int(rng.integers(num_docs)))
        train[q] = {d: 1 for d in pos}
    dataset = DatasetIndex(format="beir", num_docs=num_docs,
                           queries={q: f"text of {q}" for q in qids}, train=train, dev={},
                           test={}, warnings=[], empty_doc_count=0)
    train_ids = sorted(train)
    index = AnnIndex(dim)
    half = num_docs // 2
    index.add(np.arange(half), docs[:half])
    index.add(np.arange(half, num_docs), docs[half:])
    index.finalize()
    return World(docs=docs, queries=np.stack([raw[q] for q in train_ids]), train_ids=train_ids,
                 positives=[set(train[q]) for q in train_ids], dataset=dataset, index=index)


def _mine(world: World, config: NegativesConfig, step: int, previous: NegativesTable | None,
          temperature: float = 1.0, seed: int = 3) -> NegativesTable:
    miner = Miner(config, temperature, world.dataset, world.train_ids, seed)
    ranked, sims = world.index.search(world.queries, max(100, miner.depth())
                                      + miner.max_positives)
    return miner.mine(step, world.index, world.queries, ranked, sims, previous)


def _simans(scores: list[float], positive: float, a: float, b: float) -> list[float]:
    """Eq. 4 written out: exp(-a (s_i - s+ - b)^2), normalised (float64, no tricks)."""
    weights = [math.exp(-a * (s - positive - b) ** 2) for s in scores]
    total = sum(weights)
    return [w / total for w in weights]


# --------------------------------------------------------------------------- 1. SimANS


SIMANS_SCORES = np.array([[3.0, 2.0, 1.0, 7.0], [5.0, 4.5, -3.0, 0.0]], np.float32)
SIMANS_CANDIDATES = np.array([[10, 11, 12, PAD], [20, 21, PAD, PAD]], np.int64)
SIMANS_POSITIVE = np.array([2.5, 4.0], np.float32)


def test_simans_hand_values_a_half_b_zero() -> None:
    # Row 0: s - s+ = 0.5, -0.5, -1.5 → weights e^-0.125, e^-0.125, e^-1.125
    #        → p = 1/(2 + e^-1), 1/(2 + e^-1), e^-1/(2 + e^-1).
    # Row 1: s - s+ = 1.0, 0.5 → weights e^-0.5, e^-0.125 → p0 = 1/(1 + e^0.375).
    p = simans_probabilities(SIMANS_SCORES, SIMANS_CANDIDATES, SIMANS_POSITIVE, 0.5, 0.0)
    expected = np.array([[0.4223188, 0.4223188, 0.1553624, 0.0],
                         [0.4073334, 0.5926666, 0.0, 0.0]])
    np.testing.assert_allclose(p, expected, atol=1e-6)


@pytest.mark.parametrize(("a", "b"), [(0.5, 0.0), (1.0, 0.5), (2.0, -1.0), (0.1, 3.0)])
def test_simans_matches_eq4_for_several_a_b(a: float, b: float) -> None:
    p = simans_probabilities(SIMANS_SCORES, SIMANS_CANDIDATES, SIMANS_POSITIVE, a, b)
    for row in range(2):
        valid = SIMANS_CANDIDATES[row] != PAD
        expected = _simans(SIMANS_SCORES[row][valid].tolist(), float(SIMANS_POSITIVE[row]), a, b)
        np.testing.assert_allclose(p[row][valid], expected, rtol=1e-5, atol=1e-7)
        assert np.all(p[row][~valid] == 0.0)  # padding (even with a large score) gets nothing
        assert p[row].sum() == pytest.approx(1.0, abs=1e-6)


def test_simans_numerically_stable_for_large_scores() -> None:
    scores = np.array([[1000.0, 1001.0, 1003.0, 0.0],
                       [1000.0, 2000.0, 3000.0, 4000.0],
                       [1e4, -1e4, 0.0, 0.0],
                       [5.0, 5.0, 5.0, 5.0]], np.float32)
    candidates = np.array([[1, 2, 3, PAD], [1, 2, 3, 4], [7, 8, PAD, PAD], [PAD] * 4])
    positive = np.array([1001.0, 0.0, 0.0, 5.0], np.float32)
    p = simans_probabilities(scores, candidates, positive, 0.5, 0.0)
    assert np.isfinite(p).all()
    np.testing.assert_allclose(p[0, :3], _simans([-1.0, 0.0, 2.0], 0.0, 0.5, 0.0), rtol=1e-5)
    assert p[0, 3] == 0.0
    # Every exponent underflows (-5e5 … -8e6): the least-penalised candidate takes all mass.
    np.testing.assert_allclose(p[1], [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(p[2], [0.5, 0.5, 0.0, 0.0])  # symmetric around s+ = 0
    np.testing.assert_array_equal(p[3], 0.0)  # a row without candidates: zeros, no NaN


def test_simans_sampling_frequencies_chi_square() -> None:
    scores = np.array([[2.0, 1.5, 1.0, 0.0, 0.5, -0.5, 0.0]], np.float32)
    candidates = np.array([[40, 41, 42, PAD, 43, 44, PAD]], np.int64)
    positive = np.array([1.2], np.float32)
    a, b = 0.5, 0.0
    probs = simans_probabilities(scores, candidates, positive, a, b)
    table = NegativesTable(step=1, query_ids=np.array(["q"]), candidates=candidates,
                           scores=scores, positive_scores=positive, probabilities=probs,
                           sources=np.where(candidates != PAD, ANN, -1).astype(np.int8))
    docs = [40, 41, 42, 43, 44]
    expected = np.array(_simans([2.0, 1.5, 1.0, 0.5, -0.5], 1.2, a, b))
    rng = np.random.default_rng(1234)
    draws = 20000
    counts = dict.fromkeys(docs, 0)
    for _ in range(draws):
        (doc,) = table.sample("q", 1, rng)
        counts[doc] += 1  # a PAD or foreign document raises KeyError here
    observed = np.array([counts[d] for d in docs])
    assert stats.chisquare(observed, draws * expected).pvalue > 0.001
    # Negative control: the same frequencies are clearly not uniform.
    uniform = np.full(len(docs), draws / len(docs))
    assert stats.chisquare(observed, uniform).pvalue < 0.001


def test_simans_sampling_several_negatives_when_far_candidates_underflow() -> None:
    """Cosine similarities 0.90 … 0.20 with τ = 0.01 (DANCE's setting) and s(q, d̃⁺) = 0.92/τ:
    Eq. 4 gives e^-2 against e^-512 … e^-2592, i.e. exactly 0 in float32 for all but one
    candidate. Drawing ``per_query = 2`` negatives from such a row must still work (the
    table's contract: n distinct negatives, fewer only if the row is short)."""
    tau = 0.01
    scores = np.array([[0.90, 0.60, 0.40, 0.20]], np.float32) / tau
    candidates = np.array([[1, 2, 3, 4]], np.int64)
    positive = np.array([0.92 / tau], np.float32)
    probs = simans_probabilities(scores, candidates, positive, 0.5, 0.0)
    assert probs[0, 0] == pytest.approx(1.0) and probs[0].sum() == pytest.approx(1.0)
    table = NegativesTable(step=1, query_ids=np.array(["q"]), candidates=candidates,
                           scores=scores, positive_scores=positive, probabilities=probs,
                           sources=np.full((1, 4), ANN, np.int8))
    rng = np.random.default_rng(0)
    for _ in range(20):
        picked = table.sample("q", 2, rng)
        assert 1 <= len(picked) <= 2 and len(set(picked)) == len(picked)
        assert 1 in picked and set(picked) <= {1, 2, 3, 4}


def test_simans_miner_uses_temperature_scaled_scores_and_a_positive_anchor() -> None:
    world = _world(num_queries=15, seed=11)
    tau, a, b = 0.5, 0.5, 0.1
    config = NegativesConfig(pool="ann", sampling="simans", simans={"a": a, "b": b, "top_k": 8},
                             top_k=20)
    table = _mine(world, config, step=4, previous=None, temperature=tau)
    assert table.candidates.shape[1] == 8  # SimANS samples from its own top-k, not top_k
    for row, (q, pos) in enumerate(zip(world.queries, world.positives, strict=True)):
        expected_docs = _brute_top(q, world.docs, pos, 8)
        assert table.candidates[row].tolist() == expected_docs
        s = [float(np.dot(q.astype(np.float64), world.docs[d])) / tau for d in expected_docs]
        np.testing.assert_allclose(table.scores[row], s, rtol=1e-4, atol=1e-4)
        # d̃⁺ is one of the query's positives: s(q, d̃⁺) is one of theirs.
        positive_options = [float(np.dot(q.astype(np.float64), world.docs[d])) / tau
                            for d in sorted(pos)]
        s_pos = float(table.positive_scores[row])
        assert min(abs(s_pos - o) for o in positive_options) < 1e-4
        np.testing.assert_allclose(table.probabilities[row], _simans(s, s_pos, a, b),
                                   rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- 2. ANCE


@pytest.mark.parametrize("top_k", [10, 48])
def test_ance_miner_is_brute_force_top_k_minus_positives_uniform(top_k: int) -> None:
    world = _world(num_queries=20, seed=5)
    config = NegativesConfig(pool="ann", sampling="uniform", top_k=top_k)
    table = _mine(world, config, step=2, previous=None)
    assert table.step == 2 and table.query_ids.tolist() == world.train_ids
    for row, (q, pos) in enumerate(zip(world.queries, world.positives, strict=True)):
        expected = _brute_top(q, world.docs, pos, top_k)  # 48: rows shorter than K, padded
        got = table.candidates[row]
        assert got[got != PAD].tolist() == expected
        assert np.all(got[len(expected):] == PAD)
        assert not pos & set(got.tolist())
        np.testing.assert_allclose(table.probabilities[row, : len(expected)],
                                   1.0 / len(expected), rtol=1e-6)
        assert np.all(table.probabilities[row, len(expected):] == 0)
        assert np.all(table.sources[row, : len(expected)] == ANN)
    rng = np.random.default_rng(0)
    for draw in range(2000):
        row = draw % len(world.train_ids)
        picked = table.sample(world.train_ids[row], 1, rng)
        assert len(picked) == 1 and picked[0] != PAD
        assert picked[0] not in world.positives[row]


def test_drop_near_positive_hand_example() -> None:
    candidates = np.array([[7, 3, 9, 4], [5, 6, PAD, PAD]])
    sims = np.array([[0.9, 0.5, 0.8, 0.1], [0.2, 0.7, 0.0, 0.0]], dtype=np.float32)
    positive = np.array([0.8, 0.5], dtype=np.float32)
    ids, kept = drop_near_positive(candidates, sims, positive, ratio=0.95)  # 0.76 and 0.475
    assert ids.tolist() == [[3, 4, PAD, PAD], [5, PAD, PAD, PAD]]
    np.testing.assert_allclose(kept, [[0.5, 0.1, 0, 0], [0.2, 0, 0, 0]])


def test_ance_miner_drops_candidates_near_the_positive() -> None:
    world = _world(num_queries=30, seed=8)
    top_k, ratio, tau = 20, 0.9, 0.5
    config = NegativesConfig(pool="ann", sampling="uniform", top_k=top_k,
                             max_positive_ratio=ratio)
    table = _mine(world, config, step=3, previous=None, temperature=tau)
    dropped = 0
    for row, (q, pos) in enumerate(zip(world.queries, world.positives, strict=True)):
        s_pos = float(table.positive_scores[row]) * tau  # the anchor positive's similarity
        top = _brute_top(q, world.docs, pos, top_k)
        expected = [d for d in top if float(np.dot(q, world.docs[d])) <= ratio * s_pos]
        dropped += len(top) - len(expected)
        got = table.candidates[row]
        assert got[got != PAD].tolist() == expected
        np.testing.assert_allclose(table.probabilities[row, : len(expected)],
                                   1.0 / len(expected) if expected else 0.0, rtol=1e-6)
        assert np.all(table.probabilities[row, len(expected):] == 0)
    assert dropped > 0  # the world puts positives at ranks 0 and 2: rank 1 is near them


def test_ance_remine_fraction_keeps_previous_rows_exactly() -> None:
    world = _world(num_queries=200, seed=7)
    top_k, step = 5, 7
    rng = np.random.default_rng(99)
    absent = set(world.train_ids[:10])  # no previous row: always mined
    rows, probs, first, sources = {}, {}, {}, {}
    order = list(rng.permutation(world.train_ids))  # previous rows in another order
    for qid in order:
        if qid in absent:
            continue
        i = world.train_ids.index(qid)
        pool = [d for d in range(len(world.docs)) if d not in world.positives[i]]
        rows[qid] = [int(d) for d in rng.choice(pool, size=top_k, replace=False)]
        probs[qid] = [0.4, 0.3, 0.15, 0.1, 0.05]
        first[qid] = [1, 2, 1, 3, 3]
        sources[qid] = [ANN, BM25, ANN, MOMENTUM, ANN]
    previous = _table(3, rows, probs, first)
    for qid, codes in sources.items():
        previous.sources[previous.row(qid)] = codes
    previous.scores[:] = rng.normal(size=previous.scores.shape).astype(np.float32)

    fresh = _mine(world, NegativesConfig(pool="ann", top_k=top_k), step, previous)
    half = _mine(world, NegativesConfig(pool="ann", top_k=top_k, remine_fraction=0.5), step,
                 previous)
    new_rows = kept_rows = 0
    for row, qid in enumerate(world.train_ids):
        expected = _brute_top(world.queries[row], world.docs, world.positives[row], top_k)
        assert fresh.candidates[row].tolist() == expected
        # first_seen of a fresh row: carried over for candidates already in the previous row
        old_first = dict(zip(rows.get(qid, []), first.get(qid, []), strict=True))
        assert fresh.first_seen[row].tolist() == [old_first.get(d, step) for d in expected]
        if qid in rows:
            assert rows[qid] != expected  # the two cases can be told apart
        if half.candidates[row].tolist() == expected:
            new_rows += qid not in absent
            for name in ("candidates", "scores", "probabilities", "sources", "first_seen"):
                np.testing.assert_array_equal(getattr(half, name)[row],
                                              getattr(fresh, name)[row], err_msg=name)
        else:
            assert qid not in absent, f"{qid} has no previous row yet was not mined"
            kept_rows += 1
            old = previous.row(qid)
            for name in ("candidates", "scores", "probabilities", "sources", "first_seen"):
                np.testing.assert_array_equal(getattr(half, name)[row],
                                              getattr(previous, name)[old], err_msg=name)
    assert new_rows + kept_rows == 190
    assert 0.35 * 190 <= new_rows <= 0.65 * 190, (new_rows, kept_rows)

    # A BM25 table (step -1) is not an ANN refresh: every row is mined.
    bm25 = _table(-1, rows, probs, source=BM25)
    all_new = _mine(world, NegativesConfig(pool="ann", top_k=top_k, remine_fraction=0.5),
                    step, bm25)
    for row in range(len(world.train_ids)):
        assert all_new.candidates[row].tolist() == fresh.candidates[row].tolist()


# --------------------------------------------------------------------------- 3. ANCE-Tele


def test_mix_rows_hand_example() -> None:
    ann = (np.array([[1, 2, 3, PAD], [7, 8, PAD, PAD]]),
           np.array([[0.5, 0.3, 0.2, 0.0], [0.5, 0.5, 0.0, 0.0]]), ANN, 1.0)
    mom = (np.array([[3, 4, PAD, PAD], [PAD] * 4]),
           np.array([[0.6, 0.4, 0.0, 0.0], [0.0] * 4]), MOMENTUM, 0.5)
    look = (np.array([[4, 5, 1, PAD], [8, 9, PAD, PAD]]),
            np.array([[0.5, 0.25, 0.25, 0.0], [0.2, 0.8, 0.0, 0.0]]), LOOKAHEAD, 0.5)
    ids, probs, sources = mix_rows([ann, mom, look], max_candidates=6)
    # Row 0, masses: 1: 0.5 + 0.5*0.25 = 0.625; 2: 0.3; 3: 0.2 + 0.5*0.6 = 0.5;
    # 4: 0.5*0.4 + 0.5*0.5 = 0.45; 5: 0.5*0.25 = 0.125; total 1 + α + β = 2.
    assert ids[0].tolist() == [1, 3, 4, 2, 5, PAD]  # most probable first
    np.testing.assert_allclose(probs[0], [0.3125, 0.25, 0.225, 0.15, 0.0625, 0.0], atol=1e-7)
    assert sources[0].tolist() == [ANN, ANN, MOMENTUM, ANN, LOOKAHEAD, -1]
    # Row 1 has no momentum: (p_ann + 0.5 p_look) / 1.5.
    # 7: 0.5/1.5; 8: (0.5 + 0.1)/1.5 = 0.4; 9: 0.4/1.5.
    assert ids[1].tolist() == [8, 7, 9, PAD, PAD, PAD]
    np.testing.assert_allclose(probs[1, :3], [0.4, 1 / 3, 0.4 / 1.5], atol=1e-7)
    assert sources[1].tolist() == [ANN, ANN, LOOKAHEAD, -1, -1, -1]

    # Two parts with unequal weights: p = (w1 p1 + w2 p2) / (w1 + w2) for the shared doc 5;
    # the source is the first part's even when listed second in it.
    ids, probs, sources = mix_rows(
        [(np.array([[5, 6]]), np.array([[0.25, 0.75]]), MOMENTUM, 2.0),
         (np.array([[6, 5]]), np.array([[0.1, 0.9]]), ANN, 1.0)], max_candidates=2)
    got = dict(zip(ids[0].tolist(), probs[0].tolist(), strict=True))
    assert got[5] == pytest.approx((2.0 * 0.25 + 1.0 * 0.9) / 3.0)
    assert got[6] == pytest.approx((2.0 * 0.75 + 1.0 * 0.1) / 3.0)
    assert sources[0].tolist() == [MOMENTUM, MOMENTUM]

    # Cap: the three most probable of row 0 (masses 0.625, 0.5, 0.45), renormalised.
    ids, probs, sources = mix_rows([ann, mom, look], max_candidates=3)
    assert ids[0].tolist() == [1, 3, 4]
    np.testing.assert_allclose(probs[0], np.array([0.625, 0.5, 0.45]) / 1.575, atol=1e-7)
    assert sources[0].tolist() == [ANN, ANN, MOMENTUM]


def test_mix_rows_alpha_beta_half_gives_the_mixture() -> None:
    rng = np.random.default_rng(8)
    parts, dense = [], []
    for code, weight in ((ANN, 1.0), (MOMENTUM, 0.5), (LOOKAHEAD, 0.5)):
        cand = np.stack([rng.choice(12, size=5, replace=False) for _ in range(3)])
        p = rng.random((3, 5))
        p /= p.sum(axis=1, keepdims=True)
        parts.append((cand, p, code, weight))
        full = np.zeros((3, 12))
        for r in range(3):
            full[r, cand[r]] = p[r]
        dense.append(full)
    expected = (dense[0] + 0.5 * dense[1] + 0.5 * dense[2]) / 2.0
    ids, probs, _ = mix_rows(parts, max_candidates=12)
    for r in range(3):
        got = np.zeros(12)
        valid = ids[r] != PAD
        got[ids[r][valid]] = probs[r][valid]
        np.testing.assert_allclose(got, expected[r], atol=1e-6)


def _tele_expected(world: World, row: int, k: int, alpha: float, beta: float,
                   previous: dict[int, float] | None) -> tuple[dict[int, float], dict[int, int]]:
    """Brute-force Eq. 4-6 mixture of one row (uniform sampling, one positive per query)."""
    pos = world.positives[row]
    (anchor,) = pos
    ann = _brute_top(world.queries[row], world.docs, pos, k)
    look = _brute_top(world.docs[anchor], world.docs, pos, k)
    parts = [(dict.fromkeys(ann, 1 / len(ann)), ANN, 1.0)]
    if previous is not None:
        parts.append((previous, MOMENTUM, alpha))
    parts.append((dict.fromkeys(look, 1 / len(look)), LOOKAHEAD, beta))
    total = sum(w for _, _, w in parts)
    probs: dict[int, float] = {}
    sources: dict[int, int] = {}
    for dist, code, weight in parts:
        for doc, p in dist.items():
            probs[doc] = probs.get(doc, 0.0) + weight * p / total
            sources.setdefault(doc, code)
    return probs, sources


@pytest.mark.parametrize(("alpha", "beta"), [(0.5, 0.5), (0.2, 0.8)])
def test_tele_miner_episode_zero_then_momentum(alpha: float, beta: float) -> None:
    world = _world(num_queries=12, seed=21, multi_positive=False)
    k, tau = 5, 0.5
    config = NegativesConfig(pool="tele", sampling="uniform", top_k=k,
                             tele={"momentum_weight": alpha, "lookahead_weight": beta})
    episode0 = _mine(world, config, step=0, previous=None, temperature=tau)
    assert not (episode0.sources == MOMENTUM).any()  # Eq. 7: no momentum in episode 0
    look_only = shared = 0
    for row, qid in enumerate(world.train_ids):
        probs, sources = _tele_expected(world, row, k, alpha, beta, None)
        got = _row(episode0, qid)
        assert got.keys() == probs.keys()
        for doc, p in probs.items():
            assert got[doc] == pytest.approx(p, abs=1e-6), (qid, doc)
        assert _row(episode0, qid, "sources") == sources
        assert sum(got.values()) == pytest.approx(1.0, abs=1e-6)
        assert not world.positives[row] & got.keys()
        for doc, s in _row(episode0, qid, "scores").items():
            assert s == pytest.approx(float(world.queries[row] @ world.docs[doc]) / tau,
                                      abs=1e-4)
        look_only += sum(1 for s in sources.values() if s == LOOKAHEAD)
        shared += len(probs) < 2 * k
    assert look_only > 0 and shared > 0  # the example exercises both cases

    # Momentum from a previous ANN refresh (step ≥ 0) whose rows are disjoint from the rest.
    rng = np.random.default_rng(4)
    rows, prev_probs = {}, {}
    for row, qid in enumerate(reversed(world.train_ids)):  # another row order
        i = world.train_ids.index(qid)
        taken = set(_tele_expected(world, i, k, alpha, beta, None)[0]) | world.positives[i]
        free = [d for d in range(len(world.docs)) if d not in taken]
        rows[qid] = [int(d) for d in rng.choice(free, size=4, replace=False)]
        prev_probs[qid] = [0.4, 0.3, 0.2, 0.1] if row % 2 else [0.1, 0.2, 0.3, 0.4]
    previous = _table(2, rows, prev_probs)
    episode1 = _mine(world, config, step=3, previous=previous, temperature=tau)
    for row, qid in enumerate(world.train_ids):
        momentum = dict(zip(rows[qid], prev_probs[qid], strict=True))
        probs, sources = _tele_expected(world, row, k, alpha, beta, momentum)
        got = _row(episode1, qid)
        assert got.keys() == probs.keys()
        for doc, p in probs.items():
            assert got[doc] == pytest.approx(p, abs=1e-6), (qid, doc)
        got_sources = _row(episode1, qid, "sources")
        assert got_sources == sources
        momentum_mass = sum(p for d, p in got.items() if got_sources[d] == MOMENTUM)
        assert momentum_mass == pytest.approx(alpha / (1 + alpha + beta), abs=1e-6)
        assert sum(got.values()) == pytest.approx(1.0, abs=1e-6)

    # Overlapping momentum: the previous teleportation table itself.
    episode1b = _mine(world, config, step=3, previous=episode0, temperature=tau)
    for row, qid in enumerate(world.train_ids):
        probs, sources = _tele_expected(world, row, k, alpha, beta, _row(episode0, qid))
        got = _row(episode1b, qid)
        assert got.keys() == probs.keys()
        for doc, p in probs.items():
            assert got[doc] == pytest.approx(p, abs=1e-6), (qid, doc)

    # A BM25 warm-up table (step -1) is not an ANCE-Tele episode: no momentum from it.
    warm = _mine(world, config, step=3, previous=_table(-1, rows, prev_probs, source=BM25),
                 temperature=tau)
    assert not (warm.sources == MOMENTUM).any()


def test_tele_cap_keeps_most_probable() -> None:
    world = _world(num_queries=6, seed=21, multi_positive=False)
    config = NegativesConfig(pool="tele", top_k=5, tele={"max_candidates": 3})
    table = _mine(world, config, step=0, previous=None)
    assert table.candidates.shape[1] == 3
    for row, qid in enumerate(world.train_ids):
        probs, _ = _tele_expected(world, row, 5, 0.5, 0.5, None)
        got = _row(table, qid)
        top3 = sorted(probs.values(), reverse=True)[:3]
        assert sorted(got.values(), reverse=True) == pytest.approx(
            [p / sum(top3) for p in top3], abs=1e-6)
        assert all(got[d] == pytest.approx(probs[d] / sum(top3), abs=1e-6) for d in got)


# --------------------------------------------------------------------------- 4. DANCE


def _unit(v: list[float]) -> list[float]:
    n = math.sqrt(sum(x * x for x in v))
    return [x / n for x in v]


def _neg_log_softmax_first(logits: list[float]) -> float:
    """-log(e^{l_0} / sum_j e^{l_j}), by hand (stable log-sum-exp)."""
    top = max(logits)
    return top + math.log(sum(math.exp(x - top) for x in logits)) - logits[0]


def test_dance_total_loss_by_hand() -> None:
    tau, lam = 0.01, 0.1
    # All in a narrow cone, so that the masked columns would change the loss if let in.
    raw_q = [[1.0, 0.2, 0.0], [1.0, 0.0, 0.2]]                     # q0, q1
    raw_neg_q = [[1.0, 0.3, 0.02], [1.0, 0.02, 0.3]]               # negative queries of d0, d1
    raw_d = [[2.0, 0.5, 0.1], [3.0, 0.15, 0.75],                   # d0+, d1+ (other norms)
             [1.0, 0.15, 0.1], [1.0, 0.1, 0.35]]                   # hard negatives of q0, q1
    q = functional.normalize(torch.tensor(raw_q + raw_neg_q), dim=-1)
    d = functional.normalize(torch.tensor(raw_d), dim=-1)
    scores_main = q[:2] @ d.T / tau                       # as TextEncoder.score
    scores_dual = d[:2] @ q.T / tau                       # d⁺ against every query text
    positive = torch.arange(2)
    allowed = torch.tensor([[True, False, True, False], [False, True, False, True]])
    dual_allowed = torch.tensor([[True, False, True, False], [False, True, False, True]])
    total = (contrastive_nll(scores_main, positive, allowed)
             + lam * contrastive_nll(scores_dual, positive, dual_allowed))

    def f(a: list[float], b: list[float]) -> float:  # Eq. 6: cosine of the raw vectors
        return sum(x * y for x, y in zip(_unit(a), _unit(b), strict=True)) / tau

    # Eq. 7: -log e^{f(q,d+)/τ} / (e^{f(q,d+)/τ} + Σ e^{f(q,d-)/τ}), mean over the batch.
    l_norm = [_neg_log_softmax_first([f(raw_q[i], raw_d[i]), f(raw_q[i], raw_d[2 + i])])
              for i in range(2)]
    # Eq. 10: -log e^{f(d+,q+)/τ} / (e^{f(d+,q+)/τ} + Σ e^{f(d+,q-)/τ}).
    l_dual = [_neg_log_softmax_first([f(raw_d[i], raw_q[i]), f(raw_d[i], raw_neg_q[i])])
              for i in range(2)]
    expected = sum(l_norm) / 2 + lam * sum(l_dual) / 2   # Eq. 12
    assert min(l_norm + l_dual) > 0.05  # not saturated: every term matters
    assert float(total) == pytest.approx(expected, rel=1e-4)
    everything = torch.ones(2, 4, dtype=torch.bool)  # control: the masks do matter here
    assert float(contrastive_nll(scores_main, positive, everything)) > sum(l_norm) / 2 + 1e-3
    assert float(contrastive_nll(scores_dual, positive, dual_allowed)) == pytest.approx(
        sum(l_dual) / 2, rel=1e-4)


def _dance_world() -> tuple[World, list[str]]:
    rng = np.random.default_rng(31)
    train = {"q1": {0: 1}, "q2": {1: 1}, "q3": {2: 1, 0: 1}, "q10": {3: 1},
             "q11": {4: 1, 5: 1}, "q20": {5: 1}}
    queries = {q: f"text of {q}" for q in train} | {"t1": "text of a test query"}
    dataset = DatasetIndex(format="beir", num_docs=8, queries=queries, train=train, dev={},
                           test={"t1": {6: 1}}, warnings=[], empty_doc_count=0)
    train_ids = sorted(train)  # q1, q10, q11, q2, q20, q3
    docs = rng.normal(size=(8, 6)).astype(np.float32)
    index = AnnIndex(6)
    index.add(np.arange(8), docs)
    index.finalize()
    queries_matrix = rng.normal(size=(len(train_ids), 6)).astype(np.float32)
    world = World(docs=docs, queries=queries_matrix, train_ids=train_ids,
                  positives=[set(train[q]) for q in train_ids], dataset=dataset, index=index)
    return world, train_ids


def test_dual_query_negatives_hand_example() -> None:
    ranked = np.array([[0, 1, 2, 3], [3, 2, 1, 0]])
    scores = np.array([[4.0, 3.0, 2.0, 1.0], [9.0, 8.0, 7.0, 6.0]], np.float32)
    names = ["qa", "qb", "qc", "qd"]
    table = dual_query_negatives([7, 9], ranked, scores, {7: {1}, 9: {3, 0}}, top_k=2, step=5,
                                 query_ids=names)
    assert table.query_ids.tolist() == ["7", "9"] and table.step == 5
    assert table.candidate_query_ids.tolist() == names
    restored = NegativesTable.from_bytes(table.to_bytes())
    assert restored.candidate_query_ids.tolist() == names
    assert table.candidates.tolist() == [[0, 2], [2, 1]]
    np.testing.assert_allclose(table.scores, [[4.0, 2.0], [8.0, 7.0]])
    np.testing.assert_allclose(table.probabilities, 0.5)


def test_mine_dual_is_brute_force_nearest_training_queries_minus_owners() -> None:
    world, train_ids = _dance_world()
    config = NegativesConfig(dance={"dual_weight": 0.1, "top_k": 3})
    table = mine_dual(4, config, world.dataset, train_ids, world.index, world.queries)
    owners = {d: {r for r, q in enumerate(train_ids) if d in world.dataset.train[q]}
              for d in range(8)}
    docs = sorted(d for d, o in owners.items() if o)
    assert table.query_ids.tolist() == [str(d) for d in docs] and table.step == 4
    for doc in docs:
        row = table.row(str(doc))
        expected = _brute_top(world.docs[doc], world.queries, owners[doc], 3)
        assert table.candidates[row].tolist() == expected
        assert not owners[doc] & set(expected)
        np.testing.assert_allclose(table.probabilities[row], 1 / 3, rtol=1e-6)


def test_batch_builder_dual_columns() -> None:
    world, train_ids = _dance_world()
    dataset = world.dataset
    dual = mine_dual(4, NegativesConfig(dance={"dual_weight": 0.1, "top_k": 10}), dataset,
                     train_ids, world.index, world.queries)
    # dance.top_k above the number of training queries: every non-owner is a candidate.
    allowed_texts = {}
    for doc_key in dual.query_ids:
        row = dual.row(str(doc_key))
        cands = dual.candidates[row][dual.candidates[row] != PAD]
        allowed_texts[int(doc_key)] = {dataset.queries[train_ids[c]] for c in cands}
        owners = {q for q in train_ids if int(doc_key) in dataset.train[q]}
        assert allowed_texts[int(doc_key)] == {dataset.queries[q] for q in train_ids} - {
            dataset.queries[q] for q in owners}
    text_to_qid = {dataset.queries[q]: q for q in train_ids}
    source = RandomNegatives(8, {q: list(p) for q, p in dataset.train.items()})
    builder = BatchBuilder(dataset, batch_size=3, negatives_per_query=1,
                           in_batch_negatives=True, seed=0)
    seen_pairs = set()
    for _ in range(40):
        batch = builder.build(source, dual, 2)
        size = len(batch.query_ids)
        texts = batch.dual_query_texts
        mask = batch.dual_allowed
        assert mask is not None and tuple(mask.shape) == (size, size + len(texts))
        column = size
        for i, qid in enumerate(batch.query_ids):
            doc = batch.doc_indices[i]
            assert doc in dataset.train[qid]                  # column i of docs: d_i⁺ of q_i
            assert batch.query_texts[i] == dataset.queries[qid]  # column i of dual: q_i⁺
            expected_row = torch.zeros(size, dtype=torch.bool)
            expected_row[i] = True
            assert torch.equal(mask[i, :size], expected_row)
            own = mask[i, size:].nonzero().flatten().tolist()
            assert own == list(range(column - size, column - size + 2))
            for c in own:
                text = texts[c]
                assert text in text_to_qid, text              # a training query's text
                negative_qid = text_to_qid[text]
                assert doc not in dataset.train[negative_qid]  # never an owner of d_i⁺
                assert text in allowed_texts[doc]
                seen_pairs.add((doc, negative_qid))
            column += 2
        assert column == size + len(texts)
        assert int(mask.sum()) == size + len(texts)  # each negative query belongs to one row
    assert len(seen_pairs) >= 10


# --------------------------------------------------------------------------- 5. Baselines


def test_random_negatives_never_positive_no_duplicates_uniform() -> None:
    source = RandomNegatives(10, {"q": [2, 5], "r": []})
    rng = np.random.default_rng(5)
    for _ in range(300):
        picked = source.sample("q", 3, rng)
        assert len(picked) == 3 and len(set(picked)) == 3
        assert not {2, 5} & set(picked)
    assert sorted(source.sample("q", 20, rng)) == [0, 1, 3, 4, 6, 7, 8, 9]
    draws = 16000
    counts = np.zeros(10)
    for _ in range(draws):
        counts[source.sample("q", 1, rng)[0]] += 1
    assert counts[2] == counts[5] == 0
    observed = np.delete(counts, [2, 5])
    assert stats.chisquare(observed, np.full(8, draws / 8)).pvalue > 0.001
    # Negative control: the same counts against a skewed distribution fail.
    skewed = np.array([2.0, 1, 1, 1, 1, 1, 1, 1]) / 9 * draws
    assert stats.chisquare(observed, skewed).pvalue < 0.001


def test_mixed_negatives_half_from_first_source() -> None:
    first = _table(1, {"q": [100, 101, 102, 103, 104]}, source=BM25)
    second = RandomNegatives(10, {"q": [0]})
    mixed = MixedNegatives(first, second)
    rng = np.random.default_rng(6)
    draws, n = 4000, 2
    from_first = 0
    for _ in range(draws):
        picked = mixed.sample("q", n, rng)
        assert len(picked) == n and len(set(picked)) == n and 0 not in picked
        from_first += sum(d >= 100 for d in picked)
    total = draws * n
    # Binomial(total, 1/2): within 5 standard deviations.
    assert abs(from_first - total / 2) <= 5 * math.sqrt(total / 4), from_first


def test_negatives_picker_warmup_and_pools() -> None:
    bm25 = _table(-1, {"q": [1, 2]}, source=BM25)
    ann = _table(30, {"q": [3, 4]})
    random = RandomNegatives(10, {"q": [0]})
    holder = SimpleNamespace(bm25=bm25, ann=ann)
    picker = NegativesPicker(NegativesConfig(pool="ann", warmup="bm25", warmup_steps=10),
                             holder, random)
    for step in (1, 5, 10):
        source, table_step = picker.pick(step)
        assert source is bm25 and table_step == TableId.bm25(), step
    for step in (11, 12, 500):
        source, table_step = picker.pick(step)
        assert source is ann and table_step == TableId.ann(30), step

    holder0 = SimpleNamespace(bm25=bm25, ann=None)
    picker0 = NegativesPicker(NegativesConfig(pool="ann", warmup="bm25", warmup_steps=0),
                              holder0, random)
    for step in (1, 50, 5000):
        source, table_step = picker0.pick(step)
        assert source is bm25 and table_step == TableId.bm25(), step
    holder0.ann = ann
    for step in (1, 50):
        source, table_step = picker0.pick(step)
        assert source is ann and table_step == TableId.ann(30)

    in_batch = NegativesPicker(NegativesConfig(pool="in_batch"), holder, random)
    assert in_batch.pick(1) == (None, None) and in_batch.pick(99) == (None, None)
    assert not in_batch.needs_wait()
    rand = NegativesPicker(NegativesConfig(pool="random"), holder, random)
    assert rand.pick(3)[0] is random and not rand.needs_wait()
    assert picker.needs_wait()  # control: an ANN pool does wait for its first table

    # BM25 → X for a pool without ANN tables (ANCE Table 1 "BM25 → Rand"): BM25 for the
    # warm-up steps only, then the pool; step 1 waits for the BM25 table.
    warm_random = NegativesPicker(NegativesConfig(pool="random", warmup="bm25", warmup_steps=5),
                                  SimpleNamespace(bm25=None, ann=None), random)
    assert warm_random.needs_wait() and not warm_random.ready()
    warm_random.tables.bm25 = bm25
    assert warm_random.ready()
    assert [warm_random.pick(s)[1] for s in (1, 5)] == [TableId.bm25(), TableId.bm25()]
    assert warm_random.pick(6) == (random, None)
    warm_in_batch = NegativesPicker(
        NegativesConfig(pool="in_batch", warmup="bm25", warmup_steps=3), holder, random)
    assert warm_in_batch.pick(3)[0] is bm25 and warm_in_batch.pick(4) == (None, None)
    no_warm = NegativesPicker(NegativesConfig(pool="random", warmup="bm25"), holder, random)
    assert no_warm.pick(1) == (random, None) and not no_warm.needs_wait()


def test_dpr_warmup_mixes_bm25_and_random_then_switches_to_ann() -> None:
    """``warmup: bm25_random``: X starts from the DPR-style model (BM25 + random 1:1)."""
    bm25 = _table(-1, {"q": list(range(100, 140))}, source=BM25)
    ann = _table(30, {"q": [3, 4]})
    random = RandomNegatives(100, {"q": [0]})
    holder = SimpleNamespace(bm25=None, ann=None)
    picker = NegativesPicker(NegativesConfig(pool="ann", warmup="bm25_random", warmup_steps=10),
                             holder, random)
    assert picker.needs_wait() and not picker.ready()
    holder.bm25 = bm25
    assert picker.ready()
    source, table_step = picker.pick(1)
    assert isinstance(source, MixedNegatives) and table_step == TableId.bm25()
    assert source.first is bm25 and source.second is random and source.share == 0.5
    rng = np.random.default_rng(0)
    drawn = [d for _ in range(2000) for d in source.sample("q", 1, rng)]
    from_bm25 = sum(d >= 100 for d in drawn)  # BM25's candidates are 100..139, random's < 100
    assert abs(from_bm25 - 1000) <= 5 * math.sqrt(500), from_bm25
    assert 0 not in drawn  # the positive is never a negative
    # Past warmup_steps an ANN pool keeps warming up until its first table is there.
    assert isinstance(picker.pick(11)[0], MixedNegatives) and picker.pick(11)[1] == TableId.bm25()
    holder.ann = ann
    assert picker.pick(10)[1] == TableId.bm25() and picker.pick(11) == (ann, TableId.ann(30))


# --------------------------------------------------------------------------- 6. Diagnostics


def test_reciprocal_ranks_hand_example() -> None:
    ranked = np.array([[5, 3, 9, PAD], [1, 2, 3, 4], [7, 7, 8, 0], [6, 0, 0, 0]])
    positives = [{9}, {4, 2}, {6}, {6, 1}]
    np.testing.assert_allclose(reciprocal_ranks(ranked, positives), [1 / 3, 1 / 2, 0.0, 1.0])
    np.testing.assert_allclose(reciprocal_ranks(ranked, positives, depth=2),
                               [0.0, 1 / 2, 0.0, 1.0])


def test_forgetting_rate_counts_queries_that_got_worse() -> None:
    positives = [{0}, {1}, {2}, {3}]
    diagnostics = Diagnostics(["a", "b", "c", "d"], positives, seed=0)
    first = np.array([[0, 9, 8], [9, 1, 8], [9, 8, 2], [9, 8, 7]])   # RR 1, 1/2, 1/3, 0
    second = np.array([[9, 0, 8], [8, 1, 9], [2, 8, 9], [3, 8, 7]])  # 1/2, 1/2, 1, 1
    third = np.array([[0, 9, 8], [9, 8, 1], [9, 8, 7], [8, 9, 7]])   # 1, 1/3, 0, 0
    result = diagnostics.compute(first, None, None)
    assert "forgetting_rate" not in result
    assert result["train_sample_mrr@100"] == pytest.approx((1 + 1 / 2 + 1 / 3) / 4)
    result = diagnostics.compute(second, None, None)
    assert result["forgetting_rate"] == pytest.approx(1 / 4)  # only "a" got worse
    assert result["train_sample_mrr@100"] == pytest.approx(3 / 4)
    result = diagnostics.compute(third, None, None)
    assert result["forgetting_rate"] == pytest.approx(3 / 4)  # b, c, d worse; a better


def test_first_seen_carries_over_while_candidate_stays() -> None:
    previous = _table(3, {"b": [20, 21], "a": [10, 11, 12]},
                      first={"b": [3, 1], "a": [1, 3, 2]})
    candidates = np.array([[11, 13, 10, PAD], [30, 31, PAD, PAD], [21, 12, 20, 22]])
    seen = first_seen(candidates, 7, previous, ["a", "c", "b"])
    assert seen.tolist() == [[3, 7, 1, PAD], [7, 7, PAD, PAD], [1, 7, 3, 7]]
    assert first_seen(candidates, 7, None, ["a", "c", "b"]).tolist() == [
        [7, 7, 7, PAD], [7, 7, PAD, PAD], [7, 7, 7, 7]]
    # A doc that left the row and comes back later is new again.
    later = _table(7, {"a": [11, 13, 10]}, first={"a": [3, 7, 1]})
    assert first_seen(np.array([[13, 12]]), 9, later, ["a"]).tolist() == [[7, 9]]


def test_first_seen_survives_the_stored_table() -> None:
    """The indexer resumes ``previous`` from storage (``Indexer.recover``): the stored table
    must keep its first-seen steps, or every candidate restarts at the table's own step."""
    table = _table(8, {"a": [10, 11, 12]}, first={"a": [2, 5, 8]})
    loaded = NegativesTable.from_bytes(table.to_bytes())
    assert loaded.first_seen is not None
    assert loaded.first_seen.tolist() == [[2, 5, 8]]
    assert first_seen(np.array([[12, 10, 99]]), 9, loaded, ["a"]).tolist() == [[8, 2, 9]]


def test_miner_first_seen_and_composition_diagnostics() -> None:
    world = _world(num_queries=8, seed=13)
    config = NegativesConfig(pool="ann", top_k=6)
    t0 = _mine(world, config, step=0, previous=None)
    assert np.all(t0.first_seen[t0.candidates != PAD] == 0)
    t5 = _mine(world, config, step=5, previous=t0)  # same model: every candidate stays
    np.testing.assert_array_equal(t5.candidates, t0.candidates)
    assert np.all(t5.first_seen[t5.candidates != PAD] == 0)
    # Drop the second half of each previous row: those candidates are new at step 9.
    kept = {q: list(_row(t0, q))[:3] for q in world.train_ids}  # candidates, in order
    halved = _table(5, kept, first={q: [0, 0, 0] for q in kept})
    t9 = _mine(world, config, step=9, previous=halved)
    assert t9.first_seen[:, :3].tolist() == [[0] * 3] * 8
    assert t9.first_seen[:, 3:].tolist() == [[9] * 3] * 8
    diagnostics = Diagnostics(world.train_ids, world.positives, seed=0)
    ranked, _ = world.index.search(world.queries, 20)
    result = diagnostics.compute(ranked, t5, t9)
    assert result["composition_by_source"] == {"ann": 48} == source_counts(t9)
    assert result["composition_by_first_seen"] == {"0": 24, "9": 24}
    assert result["overlap_source_step"] == 5
    assert result["overlap_top100"] == pytest.approx(1.0)  # top-6 minus positives ⊂ top 20


def test_layer_grad_norms_bottom_middle_top() -> None:
    encoder = torch.nn.Module()
    encoder.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])
    encoder.head = torch.nn.ModuleList([torch.nn.Linear(2, 2)])  # shorter list: ignored
    for scale, layer in zip((1.0, 2.0, 3.0), encoder.layers, strict=True):
        layer.weight.grad = torch.full((2, 2), scale)   # norm 2·scale
        layer.bias.grad = torch.tensor([3.0, 4.0])      # norm 5
    norms = layer_grad_norms(encoder)
    assert norms == pytest.approx({"bottom": math.sqrt(4 + 25), "middle": math.sqrt(16 + 25),
                                   "top": math.sqrt(36 + 25)})
