"""The per-row Python implementations of the refresh path before vectorisation (issue 15,
item 6), kept only as references: ``tests/test_mining_vectorised.py`` checks the vectorised
code in ``src`` against them bit for bit, and ``bench/mining.py`` times them. Never shipped.

Each ``reference_*`` is the old function verbatim (only renamed); ``reference_anchors``,
``reference_owners`` and ``reference_composition`` are the old inline loops of
``Miner.mine``, ``mine_dual`` and ``Diagnostics.compute``.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from ance_train.negatives.table import PAD, NegativesTable


def reference_remove_positives(
    ranked: np.ndarray, scores: np.ndarray, positives: list[set[int]], keep: int
) -> tuple[np.ndarray, np.ndarray]:
    out_ids = np.full((len(ranked), keep), PAD, dtype=np.int64)
    out_scores = np.zeros((len(ranked), keep), dtype=np.float32)
    for row, (ids, row_scores, pos) in enumerate(zip(ranked, scores, positives, strict=True)):
        mask = ids != PAD
        if pos:
            mask &= ~np.isin(ids, np.fromiter(pos, dtype=np.int64))
        kept_ids, kept_scores = ids[mask][:keep], row_scores[mask][:keep]
        out_ids[row, : len(kept_ids)] = kept_ids
        out_scores[row, : len(kept_scores)] = kept_scores
    return out_ids, out_scores


def reference_overlap_at(candidates: np.ndarray, top: np.ndarray) -> float:
    hits = total = 0
    for cand_row, top_row in zip(candidates, top, strict=True):
        cand = cand_row[cand_row != PAD]
        hits += int(np.isin(cand, top_row[top_row != PAD]).sum())
        total += len(cand)
    return hits / total if total else 0.0


def reference_align_rows(previous: NegativesTable,
                         query_ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
    width = previous.candidates.shape[1]
    candidates = np.full((len(query_ids), width), PAD, dtype=np.int64)
    probabilities = np.zeros((len(query_ids), width), dtype=np.float32)
    for row, qid in enumerate(query_ids):
        old = previous.row(qid)
        if old is not None:
            candidates[row] = previous.candidates[old]
            probabilities[row] = previous.probabilities[old]
    return candidates, probabilities


def reference_first_seen(candidates: np.ndarray, step: int, previous: NegativesTable | None,
                         query_ids: list[str]) -> np.ndarray:
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


def reference_keep_previous_rows(new: NegativesTable, previous: NegativesTable | None,
                                 fraction: float, rng: np.random.Generator) -> np.ndarray:
    mined = rng.random(len(new)) < fraction
    if previous is None:
        return np.ones(len(new), dtype=bool)
    has_previous = np.array([previous.row(str(q)) is not None for q in new.query_ids])
    return mined | ~has_previous


def reference_merge_remined(new: NegativesTable, previous: NegativesTable,
                            remined: np.ndarray) -> None:
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


def reference_mix_rows(
    parts: list[tuple[np.ndarray, np.ndarray, int, float]], max_candidates: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def reference_anchors(positive_lists: list[list[int]], rng: np.random.Generator) -> np.ndarray:
    """``Miner.mine``'s d̃⁺: one positive drawn per query, one ``rng.integers`` call each."""
    return np.array([p[rng.integers(len(p))] for p in positive_lists], dtype=np.int64)


def reference_owners(positives: list[set[int]]) -> dict[int, set[int]]:
    """``mine_dual``'s owners: the training-query rows that have each document as a positive."""
    owners: dict[int, set[int]] = {}
    for row, docs in enumerate(positives):
        for doc in docs:
            owners.setdefault(doc, set()).add(row)
    return owners


def reference_dual_rows(positive_docs: list[int], owners: dict[int, set[int]]
                        ) -> tuple[np.ndarray, list[set[int]]]:
    """``dual_query_negatives``' row ids and per-row exclusions."""
    return (np.array([str(d) for d in positive_docs]),
            [owners.get(d, set()) for d in positive_docs])


def reference_reciprocal_ranks(ranked: np.ndarray, positives: list[set[int]],
                               depth: int = 100) -> np.ndarray:
    out = np.zeros(len(ranked), dtype=np.float64)
    for row, (ids, pos) in enumerate(zip(ranked[:, :depth], positives, strict=True)):
        hits = np.flatnonzero(np.isin(ids, list(pos)))
        if len(hits):
            out[row] = 1.0 / (hits[0] + 1)
    return out


def reference_composition(table: NegativesTable) -> dict[str, int]:
    """``Diagnostics.compute``'s ``composition_by_first_seen``."""
    assert table.first_seen is not None
    seen = table.first_seen[table.candidates != PAD]
    return {str(k): int(v) for k, v in sorted(Counter(seen.tolist()).items())}
