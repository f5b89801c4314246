"""How the indexer turns retrieval results into sampling distributions over negatives.

Pure functions over numpy arrays (rows = training queries, columns = candidates, ``PAD``
where a row is short), so each formula can be checked by hand.

- ANCE (000_*.txt §4-5): uniform over the ANN top-K minus the positives.
- SimANS (002_*.txt §4.1, Eq. 4), as written in the paper (the authors' released code
  differs in places; we follow the paper): over the top-k negatives,
  ``p_i ∝ exp(-a · (s(q, d_i) - s(q, d̃⁺) - b)²)`` with ``d̃⁺`` one positive drawn at random
  per query and refresh. ``s`` is the model's relevance score, i.e. the similarity divided by
  the temperature (the quantity the loss uses), so ``a`` and ``b`` mean the same under dot
  product and under cosine with a temperature.
- ANCE-Tele (004_*.txt §4, Eq. 4-6): the episode's negatives are the current ANN negatives,
  plus α × the previous episode's teleportation negatives (momentum), plus β × the ANN
  neighbours of the positive document (lookahead). Read as a mixture of sampling
  distributions, ``p_i = (p_ann + α·p_{i-1} + β·p_lookahead) / (1 + α + β)``; the recursion
  makes older episodes fade geometrically. Episode 0 has no momentum (Eq. 7).
- Positive-aware filtering (optional, ``negatives.max_positive_ratio``): candidates scoring
  above a fraction of the positive's similarity are dropped as likely false negatives.
"""

from __future__ import annotations

import numpy as np

from ance_train.negatives.table import PAD, SOURCE_CODE, NegativesTable


def drop_near_positive(candidates: np.ndarray, sims: np.ndarray, positive_sims: np.ndarray,
                       ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """Positive-aware false-negative filter: keep a candidate only if its similarity is at most
    ``ratio × s(q, d⁺)``; each row's survivors move to the front, in their original order.

    Unlabelled relevant documents score like the positive, so the candidates closest to (or
    above) it are the likeliest false negatives (NV-Retriever's TopK-PercPos uses 0.95).
    """
    keep = (candidates != PAD) & (sims <= ratio * positive_sims[:, None])
    order = np.argsort(~keep, axis=1, kind="stable")  # kept first, original order within
    kept = np.take_along_axis(keep, order, axis=1)
    out_ids = np.where(kept, np.take_along_axis(candidates, order, axis=1), PAD)
    out_sims = np.where(kept, np.take_along_axis(sims, order, axis=1), 0.0)
    return out_ids.astype(np.int64), out_sims.astype(sims.dtype)


def simans_probabilities(
    scores: np.ndarray, candidates: np.ndarray, positive_scores: np.ndarray, a: float, b: float
) -> np.ndarray:
    """SimANS Eq. 4 per row over the valid candidates (rows sum to 1; padding gets 0)."""
    valid = candidates != PAD
    exponent = -a * (scores - positive_scores[:, None] - b) ** 2
    exponent = np.where(valid, exponent, -np.inf)
    row_max = exponent.max(axis=1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)  # rows without candidates
    weights = np.where(valid, np.exp(exponent - row_max), 0.0)
    totals = weights.sum(axis=1, keepdims=True)
    return np.divide(weights, totals, out=np.zeros_like(weights), where=totals > 0).astype(
        np.float32)


def mix_rows(
    parts: list[tuple[np.ndarray, np.ndarray, int, float]], max_candidates: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mixture of per-row distributions: ``parts`` = [(candidates, probabilities, source, weight)].

    A document in several parts gets the summed mass and the source of the first part that
    holds it. Each row keeps its ``max_candidates`` most probable documents, renormalised.
    """
    rows = parts[0][0].shape[0]
    out_ids = np.full((rows, max_candidates), PAD, dtype=np.int64)
    out_probs = np.zeros((rows, max_candidates), dtype=np.float32)
    out_sources = np.full((rows, max_candidates), -1, dtype=np.int8)
    for row in range(rows):
        mass: dict[int, float] = {}
        source: dict[int, int] = {}
        total_weight = 0.0
        for candidates, probabilities, code, weight in parts:
            valid = candidates[row] != PAD
            if weight <= 0 or not valid.any():
                continue
            total_weight += weight
            for doc, prob in zip(candidates[row][valid], probabilities[row][valid], strict=True):
                mass[int(doc)] = mass.get(int(doc), 0.0) + weight * float(prob)
                source.setdefault(int(doc), code)
        if not mass:
            continue
        ranked = sorted(mass.items(), key=lambda item: -item[1])[:max_candidates]
        kept_total = sum(m for _, m in ranked)
        for column, (doc, m) in enumerate(ranked):
            out_ids[row, column] = doc
            out_probs[row, column] = m / kept_total
            out_sources[row, column] = source[doc]
    return out_ids, out_probs, out_sources


def align_rows(previous: NegativesTable, query_ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The previous table's candidates/probabilities re-ordered to ``query_ids`` (PAD if absent)."""
    width = previous.candidates.shape[1]
    candidates = np.full((len(query_ids), width), PAD, dtype=np.int64)
    probabilities = np.zeros((len(query_ids), width), dtype=np.float32)
    for row, qid in enumerate(query_ids):
        old = previous.row(qid)
        if old is not None:
            candidates[row] = previous.candidates[old]
            probabilities[row] = previous.probabilities[old]
    return candidates, probabilities


def first_seen(candidates: np.ndarray, step: int, previous: NegativesTable | None,
               query_ids: list[str]) -> np.ndarray:
    """Step at which each candidate entered its row, carried over from the previous table
    while the candidate stays in the row (ANCE-Tele Fig. 9 "first introduced" episodes)."""
    seen = np.where(candidates != PAD, step, PAD).astype(np.int64)
    if previous is None or previous.first_seen is None:
        return seen
    for row, qid in enumerate(query_ids):
        old = previous.row(qid)
        if old is None:
            continue
        earlier = {int(d): int(s) for d, s in zip(previous.candidates[old],
                                                  previous.first_seen[old], strict=True)
                   if d != PAD}
        for column, doc in enumerate(candidates[row]):
            if doc != PAD and int(doc) in earlier:
                seen[row, column] = earlier[int(doc)]
    return seen


def keep_previous_rows(new: NegativesTable, previous: NegativesTable | None,
                       fraction: float, rng: np.random.Generator) -> np.ndarray:
    """ANCE partial re-mining: which rows take the new negatives (True) this refresh.

    A random ``fraction`` of the queries is re-mined; the others keep their previous row
    (queries without a previous row are always mined)."""
    mined = rng.random(len(new)) < fraction
    if previous is None:
        return np.ones(len(new), dtype=bool)
    has_previous = np.array([previous.row(str(q)) is not None for q in new.query_ids])
    return mined | ~has_previous


def merge_remined(new: NegativesTable, previous: NegativesTable, remined: np.ndarray) -> None:
    """Overwrite, in place, the rows of ``new`` not re-mined with the previous table's rows."""
    width = new.candidates.shape[1]
    for row, qid in enumerate(new.query_ids):
        if remined[row]:
            continue
        old = previous.row(str(qid))
        take = min(width, previous.candidates.shape[1])
        for name in ("candidates", "scores", "probabilities", "sources", "first_seen"):
            target = getattr(new, name)
            fill = PAD if name in ("candidates", "first_seen") else 0
            if name == "sources":
                fill = -1
            target[row] = fill
            target[row, :take] = getattr(previous, name)[old][:take]


def dual_query_negatives(
    positive_docs: list[int], ranked_queries: np.ndarray, scores: np.ndarray,
    owners: dict[int, set[int]], top_k: int, step: int,
) -> NegativesTable:
    """DANCE (001_*.txt Eq. 10): negative queries of each positive document are the training
    queries nearest to it, minus the queries for which it is a positive. Rows are keyed by
    the document index (as a string); candidates are rows of the sorted training-query list."""
    from ance_train.negatives.table import remove_positives, uniform_probabilities

    kept, kept_scores = remove_positives(ranked_queries, scores,
                                         [owners.get(d, set()) for d in positive_docs], top_k)
    return NegativesTable(
        step=step, query_ids=np.array([str(d) for d in positive_docs]), candidates=kept,
        scores=kept_scores, positive_scores=np.zeros(len(positive_docs), np.float32),
        probabilities=uniform_probabilities(kept),
        sources=np.where(kept != PAD, SOURCE_CODE["ann"], -1).astype(np.int8))
