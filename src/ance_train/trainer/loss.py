"""The NLL (softmax cross-entropy) loss of ANCE §4 over positive, hard and in-batch negatives."""

from __future__ import annotations

import torch
from torch.nn import functional


def contrastive_nll(
    scores: torch.Tensor, positive_column: torch.Tensor, allowed: torch.Tensor,
    reduction: str = "mean",
) -> torch.Tensor:
    """Mean over queries of ``-log softmax(scores_i)[positive_i]`` over the allowed columns
    (``reduction="sum"``: their sum, which a data-parallel rank normalises by the global batch).

    ``scores`` is ``[queries, docs]`` (already divided by the temperature), ``allowed`` marks
    which documents count as candidates for each query: its own positive, its own hard
    negatives and, with in-batch negatives, the other queries' documents except any that are
    also positives of this query. Masked columns take no part in the softmax.
    """
    if not bool(allowed.gather(1, positive_column[:, None]).all()):
        raise ValueError("each query's positive column must be allowed")
    masked = scores.float().masked_fill(~allowed, float("-inf"))
    return functional.cross_entropy(masked, positive_column, reduction=reduction)


def layer_grad_norms(encoder: torch.nn.Module) -> dict[str, float]:
    """L2 norm of the gradients of the bottom, middle and top transformer layer (ANCE Fig. 4)."""
    layers = _transformer_layers(encoder)
    if not layers:
        return {}
    picks = {"bottom": layers[0], "middle": layers[len(layers) // 2], "top": layers[-1]}
    norms = {}
    for name, layer in picks.items():
        grads = [p.grad.detach().float() for p in layer.parameters() if p.grad is not None]
        norms[name] = float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
    return norms


def _transformer_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The longest ModuleList of the encoder: its stack of transformer blocks."""
    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        return []
    longest = max(lists, key=len)
    return list(longest)
