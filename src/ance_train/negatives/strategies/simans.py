"""SimANS: sample the ambiguous negatives, those scored close to the positive.

Paper: Kun Zhou, Yeyun Gong, Xiao Liu, Wayne Xin Zhao, Yelong Shen, Anlei Dong, Jingwen Lu,
Rangan Majumder, Ji-Rong Wen, Nan Duan, Weizhu Chen. "SimANS: Simple Ambiguous Negatives
Sampling for Dense Text Retrieval". EMNLP 2022 (Industry Track). arXiv:2210.11773.

Implements Eq. 4 of §4.1 over the top-k ranked negatives D̃⁻ (k = 100):

    p_i ∝ exp(−a · (s(q, d_i) − s(q, d̃⁺) − b)²),   d_i ∈ D̃⁻,

with ``d̃⁺`` one positive drawn at random per query and refresh (the paper's cheaper
replacement of the mean positive score of Eq. 3), ``a`` = 0.5 and ``b`` = 0 (MS MARCO).
``s`` is the model's relevance score, i.e. the similarity divided by ``model.temperature``
(the quantity the loss uses), so ``a`` and ``b`` mean the same under dot product and under
cosine with a temperature. The authors' released code differs in places (it normalises and
shifts scores differently); this follows the paper.

Sampling ``simans``: a way to draw from the candidates of an ANN pool (``ann`` or ``tele``),
which supplies the dense scores. The indexer stores the probabilities in the table; the
trainer draws by them.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ance_train.negatives.strategies.base import SamplingStrategy
from ance_train.negatives.table import PAD


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


class SimansSampling(SamplingStrategy):
    """Sampling ``simans``: Eq. 4 over the sampling's own top-k."""

    name: ClassVar[str] = "simans"
    needs_scores: ClassVar[bool] = True

    def depth(self) -> int:
        return self.config.simans_top_k

    def probabilities(self, candidates: np.ndarray, scores: np.ndarray,
                      positive_scores: np.ndarray) -> np.ndarray:
        return simans_probabilities(scores, candidates, positive_scores,
                                    self.config.simans_a, self.config.simans_b)
