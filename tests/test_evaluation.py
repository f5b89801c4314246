"""Tests of the retrieval metrics (src/ance_train/evaluation.py) against hand computations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ance_train.evaluation import (
    bootstrap_ci,
    evaluate,
    evaluate_per_query,
    evaluate_with_interval,
)

LOG2_3 = math.log2(3)

QRELS = {
    "q1": {"d1": 1, "d3": 1},
    "q2": {"d5": 1, "d8": 1},
    "q3": {"r": 1},
}
RUN = {
    # Relevant at ranks 1 and 3 (d2 is not judged).
    "q1": {"d1": 3.0, "d2": 2.0, "d3": 1.0},
    # One of two relevant documents, at rank 3.
    "q2": {"d4": 5.0, "d6": 4.0, "d5": 3.0},
    # The relevant document at rank 11: outside every @10 cutoff, inside @100.
    "q3": {**{f"n{i}": 20.0 - i for i in range(10)}, "r": 1.0},
}


def test_hand_example() -> None:
    metrics = evaluate(RUN, QRELS)
    assert set(metrics) == {"ndcg@10", "mrr@10", "recall@100", "recall@1000"}
    # q1: DCG = 1/log2(2) + 1/log2(4) = 1.5; ideal = 1 + 1/log2(3).
    ndcg_q1 = 1.5 / (1 + 1 / LOG2_3)
    # q2: DCG = 1/log2(4) = 0.5; ideal (two relevant) = 1 + 1/log2(3).
    ndcg_q2 = 0.5 / (1 + 1 / LOG2_3)
    # q3: nothing relevant in the top 10.
    assert metrics["ndcg@10"] == pytest.approx((ndcg_q1 + ndcg_q2 + 0.0) / 3, abs=1e-6)
    assert metrics["mrr@10"] == pytest.approx((1.0 + 1 / 3 + 0.0) / 3, abs=1e-6)
    assert metrics["recall@100"] == pytest.approx((1.0 + 0.5 + 1.0) / 3, abs=1e-6)
    assert metrics["recall@1000"] == pytest.approx((1.0 + 0.5 + 1.0) / 3, abs=1e-6)


def test_single_query_values() -> None:
    metrics = evaluate({"q1": RUN["q1"]}, {"q1": QRELS["q1"]})
    assert metrics["ndcg@10"] == pytest.approx(0.919721, abs=1e-6)  # 1.5 / 1.630930
    assert metrics["mrr@10"] == pytest.approx(1.0)
    assert metrics["recall@100"] == pytest.approx(1.0)


def test_query_missing_from_run_scores_zero() -> None:
    qrels = {"q1": QRELS["q1"], "missing": {"x": 1}, "empty": {"y": 1}}
    run = {"q1": RUN["q1"], "empty": {}, "not-judged": {"x": 9.0}}
    metrics = evaluate(run, qrels)
    ndcg_q1 = 1.5 / (1 + 1 / LOG2_3)
    # Mean over the three judged queries; the two without a run count as 0.
    assert metrics["ndcg@10"] == pytest.approx(ndcg_q1 / 3, abs=1e-6)
    assert metrics["mrr@10"] == pytest.approx(1 / 3, abs=1e-6)
    assert metrics["recall@100"] == pytest.approx(1 / 3, abs=1e-6)
    only_missing = evaluate({}, {"missing": {"x": 1}})
    assert only_missing == {"ndcg@10": 0.0, "mrr@10": 0.0, "recall@100": 0.0,
                            "recall@1000": 0.0}


def test_empty_qrels_returns_empty_dict() -> None:
    assert evaluate(RUN, {}) == {}
    assert evaluate({}, {}) == {}


def test_per_query_values_average_to_the_aggregate() -> None:
    per_query = evaluate_per_query(RUN, QRELS)
    assert per_query == pytest.approx({"q1": 1.5 / (1 + 1 / LOG2_3),
                                       "q2": 0.5 / (1 + 1 / LOG2_3), "q3": 0.0}, abs=1e-6)
    assert sum(per_query.values()) / 3 == pytest.approx(evaluate(RUN, QRELS)["ndcg@10"])
    recall = evaluate_per_query({"q1": RUN["q1"]}, {"q1": QRELS["q1"], "gone": {"x": 1}},
                                "recall@100")
    assert recall == {"q1": 1.0, "gone": 0.0}  # a query without a run is there, scoring 0


def test_metrics_with_interval_are_the_separate_passes_bit_for_bit() -> None:
    """evaluate_with_interval makes one pytrec_eval pass for the metrics and the per-query
    nDCG@10 of its interval: the same floats as evaluate and evaluate_per_query."""
    rng = np.random.default_rng(3)
    qrels = {f"q{i}": {f"d{j}": 1 for j in rng.choice(300, size=rng.integers(1, 4))}
             for i in range(120)}
    run = {qid: {f"d{j}": float(s) for j, s in zip(rng.choice(300, size=150, replace=False),
                                                    rng.random(150), strict=True)}
           for qid in list(qrels)[:110]}  # ten queries without a run
    metrics, interval = evaluate_with_interval(run, qrels)
    assert metrics == evaluate(run, qrels)
    per_query = evaluate_per_query(run, qrels)
    assert interval == bootstrap_ci([per_query[qid] for qid in sorted(qrels)])
    assert evaluate_with_interval(run, {}) == ({}, None)
