"""Retrieval metrics through ir-measures (pytrec_eval underneath)."""

from __future__ import annotations

import ir_measures
from ir_measures import RR, R, nDCG

MEASURES = {"ndcg@10": nDCG @ 10, "mrr@10": RR @ 10, "recall@100": R @ 100,
            "recall@1000": R @ 1000}


def evaluate(
    run: dict[str, dict[str, float]], qrels: dict[str, dict[str, int]]
) -> dict[str, float]:
    """Mean metrics over the queries of ``qrels`` (a query missing from ``run`` scores 0)."""
    if not qrels:
        return {}
    full_run = {qid: run.get(qid, {}) for qid in qrels}
    # pytrec_eval skips queries with an empty run; give them a dummy non-relevant hit.
    for qid, hits in full_run.items():
        if not hits:
            full_run[qid] = {"__none__": 0.0}
    results = ir_measures.calc_aggregate(list(MEASURES.values()), qrels, full_run)
    return {name: float(results[measure]) for name, measure in MEASURES.items()}
