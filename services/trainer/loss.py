"""The NLL (softmax cross-entropy) loss of ANCE §4 over positive, hard and in-batch negatives."""

from __future__ import annotations

import torch
from torch.nn import functional


def contrastive_nll(
    scores: torch.Tensor, positive_column: torch.Tensor, allowed: torch.Tensor
) -> torch.Tensor:
    """Mean over queries of ``-log softmax(scores_i)[positive_i]`` over the allowed columns.

    ``scores`` is ``[queries, docs]`` (already divided by the temperature), ``allowed`` marks
    which documents count as candidates for each query: its own positive, its own hard
    negatives and, with in-batch negatives, the other queries' documents except any that are
    also positives of this query. Masked columns take no part in the softmax.
    """
    if not bool(allowed.gather(1, positive_column[:, None]).all()):
        raise ValueError("each query's positive column must be allowed")
    masked = scores.float().masked_fill(~allowed, float("-inf"))
    return functional.cross_entropy(masked, positive_column)
