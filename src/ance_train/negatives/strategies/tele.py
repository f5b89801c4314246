"""ANCE-Tele: teleportation negatives against catastrophic forgetting between refreshes.

Paper: Si Sun, Chenyan Xiong, Yue Yu, Arnold Overwijk, Zhiyuan Liu, Jie Bao. "Reduce
Catastrophic Forgetting of Dense Retrieval Training with Teleportation Negatives". EMNLP 2022.
arXiv:2210.17167.

Implements Eq. 4-6 of §4, the episode-i negatives

    D_i^Tele = ANN_{f(q, ∘; θ*_{i−1})}            (4: the current ANN negatives)
             + α · D_{i−1}^Tele                    (5: momentum, the previous episode's)
             + β · ANN_{f(d⁺, ∘; θ*_{i−1})}        (6: lookahead, neighbours of the positive)

with Eq. 7: no momentum in episode 0 (a BM25 warm-up table is not an episode). Read as a
mixture of sampling distributions,

    p_i = (p_ann + α · p_{i−1} + β · p_lookahead) / (1 + α + β),

so older episodes fade by α per episode; α = β = 0.5 as in the paper
(``negatives.tele: {momentum_weight, lookahead_weight, max_candidates}``). ``p_ann`` and
``p_lookahead`` are the configured sampling strategy's distributions (uniform, or SimANS)
over the ANN top-k of the query and of ``d̃⁺`` (one positive drawn per query), positives
removed. A document in several parts gets their summed mass and the source of the first
(ann, then momentum, then lookahead); each row keeps its ``max_candidates`` most probable
documents, renormalised.

Pool ``tele`` (:class:`TelePool`): ANCE's ANN pool with the mixture above as its table.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from pydantic import Field

from ance_train.negatives.mining import align_rows
from ance_train.negatives.rows import check_packable, column_bits, row_blocks
from ance_train.negatives.strategies.ance import AnnPool
from ance_train.negatives.strategies.base import AnnRefresh, StrategySettings
from ance_train.negatives.table import PAD, SOURCE_CODE, NegativesTable, remove_positives

if TYPE_CHECKING:
    from ance_train.negatives.mining import Miner


class TeleSettings(StrategySettings):
    """``negatives.tele``: the weights of Eq. 5-6 and the cap on a row."""

    momentum_weight: float = Field(0.5, ge=0.0, description="α; paper: 0.5.")
    lookahead_weight: float = Field(0.5, ge=0.0, description="β; paper: 0.5.")
    max_candidates: int = Field(
        400, ge=1, description="Cap on a query's teleportation pool (highest probability kept).")


def mix_rows(
    parts: list[tuple[np.ndarray, np.ndarray, int, float]], max_candidates: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mixture of per-row distributions: ``parts`` = [(candidates, probabilities, source, weight)].

    A document in several parts gets the summed mass and the source of the first part that
    holds it. Each row keeps its ``max_candidates`` most probable documents, renormalised
    (ties: the document met first, parts in order, columns in order).

    Vectorised over blocks of rows: the parts side by side, one stable sort per row groups
    each document's cells in the order met; the masses are summed in that order (one pass
    per repeat, as a running sum would), so the result is the same to the last bit.
    """
    rows = parts[0][0].shape[0]
    out_ids = np.full((rows, max_candidates), PAD, dtype=np.int64)
    out_probs = np.zeros((rows, max_candidates), dtype=np.float32)
    out_sources = np.full((rows, max_candidates), -1, dtype=np.int8)
    used = [part for part in parts if part[3] > 0]
    if not used:
        return out_ids, out_probs, out_sources
    width = sum(candidates.shape[1] for candidates, _, _, _ in used)
    for block in row_blocks(rows, 4 * width):
        ids, probs, sources = _mix_block(
            [(candidates[block], probabilities[block], code, weight)
             for candidates, probabilities, code, weight in used], max_candidates)
        columns = ids.shape[1]
        out_ids[block, :columns], out_probs[block, :columns] = ids, probs
        out_sources[block, :columns] = sources
    return out_ids, out_probs, out_sources


def _mix_block(parts: list[tuple[np.ndarray, np.ndarray, int, float]], max_candidates: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`mix_rows` of one block of rows (parts of positive weight only)."""
    docs = np.concatenate([c for c, _, _, _ in parts], axis=1).astype(np.int64)
    mass = np.concatenate([weight * np.asarray(p, dtype=np.float64)
                           for _, p, _, weight in parts], axis=1)
    codes = np.concatenate([np.full(c.shape, code, dtype=np.int8)
                            for c, _, code, _ in parts], axis=1)
    rows, width = docs.shape
    # One sort per row of ``document · width + column`` (padding as one document past the
    # largest): each document's cells side by side, in the order met.
    padding = int(docs.max(initial=0)) + 1
    bits = column_bits(width)
    check_packable(padding, bits)
    packed = np.where(docs != PAD, docs, padding) << bits
    packed |= np.arange(width, dtype=np.int64)
    packed.sort(axis=1)
    # Flat from here on (1-D running maxima and gathers are the fast ones); every row
    # starts a run at its first cell, so no run crosses from one row to the next.
    packed = packed.ravel()
    column, document = packed & ((1 << bits) - 1), packed >> bits
    row_start = np.repeat(np.arange(0, rows * width, width, dtype=np.int64), width)
    mass = mass.ravel()[row_start + column] + 0.0  # as ``mass.get(doc, 0.0) + ...``
    starts = document == padding  # each padding cell on its own: no run to sum
    starts[row_start == np.arange(rows * width)] = True
    starts[1:] |= document[1:] != document[:-1]
    positions = np.arange(rows * width, dtype=np.int64)
    start = np.where(starts, positions, 0)
    np.maximum.accumulate(start, out=start)
    repeat = positions - start
    for depth in range(1, int(repeat.max(initial=0)) + 1):  # running sums, in order
        (cells,) = np.nonzero(repeat == depth)
        mass[cells] = mass[cells - 1] + mass[cells]
    totals = np.ones(rows * width, dtype=bool)  # the last cell of a document: its total
    totals[:-1] = starts[1:]
    totals &= document != padding
    # Each document's total at the column where it was first met (the other cells write
    # to a spare column), then most probable first; a stable sort keeps ties in the order
    # met (Python's sort of the old dict).
    spare_base = np.repeat(np.arange(0, rows * (width + 1), width + 1, dtype=np.int64), width)
    met = np.where(totals, column[start], width) + spare_base
    negated = np.full((rows, width + 1), np.inf)
    negated.ravel()[met] = np.where(totals, -mass, np.inf)
    ranked = np.argsort(negated[:, :width], axis=1, kind="stable")[:, :max_candidates]
    kept_negated = np.take_along_axis(negated, ranked, axis=1)
    kept = kept_negated != np.inf
    kept_mass = np.where(kept, -kept_negated, 0.0)
    total = np.cumsum(kept_mass, axis=1)[:, -1:]  # in rank order, as ``sum`` adds them
    empty = kept[:, 0] & (total[:, 0] == 0)
    if empty.any():
        raise ValueError(f"mix_rows: a row's candidates all have probability 0 "
                         f"(row {int(np.flatnonzero(empty)[0])} of its block)")
    with np.errstate(invalid="ignore", divide="ignore"):
        probs = np.where(kept, kept_mass / total, 0.0).astype(np.float32)
    ids = np.where(kept, np.take_along_axis(docs, ranked, axis=1), PAD)
    sources = np.where(kept, np.take_along_axis(codes, ranked, axis=1), -1).astype(np.int8)
    return ids, probs, sources


class TelePool(AnnPool):
    """Pool ``tele``: current ANN ∪ α·momentum ∪ β·lookahead (Eq. 4-6)."""

    name: ClassVar[str] = "tele"
    order: ClassVar[int] = 60
    remines: ClassVar[bool] = False
    settings_model = TeleSettings
    legacy_keys = MappingProxyType({"tele_momentum_weight": "momentum_weight",
                                    "tele_lookahead_weight": "lookahead_weight",
                                    "tele_max_candidates": "max_candidates"})

    def mine(self, miner: Miner, refresh: AnnRefresh) -> NegativesTable:
        tele = self.settings
        k, index = refresh.depth, refresh.index
        # Lookahead: neighbours of the positive document, minus the positives themselves.
        near, near_sims = index.search(refresh.anchor_vectors, k + miner.max_positives,
                                       refresh.search_batch, refresh.cancel)
        look, _ = remove_positives(near, near_sims, miner.positives, k)
        look_probs = miner.probabilities(look, miner.scores(index, refresh.queries, look),
                                         refresh.positive_scores)
        parts = [(refresh.candidates, refresh.probabilities, SOURCE_CODE["ann"], 1.0)]
        previous = refresh.previous
        if previous is not None and previous.step >= 0:  # Eq. 7: no momentum in episode 0
            mom, mom_probs = align_rows(previous, miner.train_ids)
            parts.append((mom, mom_probs, SOURCE_CODE["momentum"], tele.momentum_weight))
        parts.append((look, look_probs, SOURCE_CODE["lookahead"], tele.lookahead_weight))
        candidates, probabilities, sources = mix_rows(parts, tele.max_candidates)
        return miner.table(replace(
            refresh, candidates=candidates, probabilities=probabilities, sources=sources,
            scores=miner.scores(index, refresh.queries, candidates)))
