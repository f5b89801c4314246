"""Retrieval metrics through ir-measures (pytrec_eval underneath)."""

from __future__ import annotations

import ir_measures
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
