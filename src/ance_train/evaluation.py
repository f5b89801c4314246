"""Retrieval metrics through ir-measures (pytrec_eval underneath)."""

from __future__ import annotations

from collections.abc import Sequence

import ir_measures
import numpy as np
from ir_measures import RR, R, nDCG

MEASURES = {"ndcg@10": nDCG @ 10, "mrr@10": RR @ 10, "recall@100": R @ 100,
            "recall@1000": R @ 1000}


def _complete_run(run: dict[str, dict[str, float]],
                  qrels: dict[str, dict[str, int]]) -> dict[str, dict[str, float]]:
    """``run`` restricted to the queries of ``qrels``, with every one of them present:
    pytrec_eval skips queries with an empty run, so those get a dummy non-relevant hit."""
    return {qid: run.get(qid) or {"__none__": 0.0} for qid in qrels}


def evaluate(
    run: dict[str, dict[str, float]], qrels: dict[str, dict[str, int]]
) -> dict[str, float]:
    """Mean metrics over the queries of ``qrels`` (a query missing from ``run`` scores 0)."""
    if not qrels:
        return {}
    results = ir_measures.calc_aggregate(list(MEASURES.values()), qrels,
                                         _complete_run(run, qrels))
    return {name: float(results[measure]) for name, measure in MEASURES.items()}


def evaluate_per_query(
    run: dict[str, dict[str, float]], qrels: dict[str, dict[str, int]], name: str = "ndcg@10"
) -> dict[str, float]:
    """One metric of :data:`MEASURES` for every query of ``qrels`` (for paired tests); its
    mean is what :func:`evaluate` reports."""
    measure = MEASURES[name]
    return {m.query_id: float(m.value)
            for m in ir_measures.iter_calc([measure], qrels, _complete_run(run, qrels))}


# The bootstrap interval every eval report carries for its splits' nDCG@10 (``ci95``): the
# per-query scores resampled with replacement BOOTSTRAP_RESAMPLES times with a fixed seed (so
# a report is reproducible), the 2.5th and 97.5th percentiles of the resampled means.
BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 0
CI_MEASURE = "ndcg@10"


def bootstrap_ci(scores: Sequence[float] | np.ndarray, resamples: int = BOOTSTRAP_RESAMPLES,
                 seed: int = BOOTSTRAP_SEED, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``scores`` (one per query): how far the
    mean could move on another draw of as many queries. Deterministic for a given seed; it
    narrows as ~1/sqrt(len(scores)). ``ValueError`` on no scores."""
    values = np.asarray(scores, dtype=np.float64)
    if values.size == 0:
        raise ValueError("no per-query scores to bootstrap")
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, size=(resamples, values.size))].mean(axis=1)
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def evaluate_with_interval(
    run: dict[str, dict[str, float]], qrels: dict[str, dict[str, int]]
) -> tuple[dict[str, float], tuple[float, float] | None]:
    """:func:`evaluate`, and the :func:`bootstrap_ci` of its :data:`CI_MEASURE` (None when
    ``qrels`` is empty)."""
    if not qrels:
        return {}, None
    # One pass of pytrec_eval for both: ir-measures' own calc_aggregate is iter_calc into
    # each measure's aggregator (a mean), so the metrics are the same floats.
    aggregators = {measure: measure.aggregator() for measure in MEASURES.values()}
    per_query: dict[str, float] = {}
    for metric in ir_measures.iter_calc(list(MEASURES.values()), qrels,
                                        _complete_run(run, qrels)):
        aggregators[metric.measure].add(metric.value)
        if metric.measure == MEASURES[CI_MEASURE]:
            per_query[metric.query_id] = float(metric.value)
    metrics = {name: float(aggregators[measure].result()) for name, measure in MEASURES.items()}
    return metrics, bootstrap_ci([per_query.get(qid, 0.0) for qid in sorted(qrels)])


def format_interval(value: float, interval: Sequence[float] | None) -> str:
    """``0.512 [0.471, 0.553]`` (the value alone when there is no interval)."""
    if interval is None:
        return f"{value:.3f}"
    return f"{value:.3f} [{interval[0]:.3f}, {interval[1]:.3f}]"
