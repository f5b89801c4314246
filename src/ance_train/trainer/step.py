"""The gradient computation of one training step, the same code for every configuration:
one process or N data-parallel ranks (:mod:`.distributed`), with or without GradCache
(:mod:`.grad_cache`). A single process is world size 1 and GradCache off is no chunking."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ance_train.modeling.model import BiEncoder
from ance_train.trainer.distributed import (
    DistributedContext,
    RankShard,
    global_losses,
    shard_loss,
)
from ance_train.trainer.grad_cache import Inputs, grad_cache_backward


class PairEncoder(nn.Module):
    """Queries and documents in one forward call (queries first), so that DDP sees one forward
    per backward; either side may be left out (GradCache chunks).

    The encoder's pooler (BERT's ``pooler_output``, never read by :class:`BiEncoder`, which
    pools the last hidden states itself) is frozen: its gradients are always None, as they
    were, and DDP, which requires every trainable parameter to take part in the loss, needs no
    ``find_unused_parameters`` (an extra graph walk and collective every forward).
    """

    def __init__(self, model: BiEncoder) -> None:
        super().__init__()
        self.model = model
        pooler = getattr(model.encoder, "pooler", None)
        if isinstance(pooler, nn.Module):
            pooler.requires_grad_(False)

    def forward(self, query_ids: torch.Tensor | None, query_mask: torch.Tensor | None,
                doc_ids: torch.Tensor | None, doc_mask: torch.Tensor | None,
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        q = None if query_ids is None else self.model(query_ids, query_mask)
        d = None if doc_ids is None else self.model(doc_ids, doc_mask)
        return q, d


def data_parallel(encoder: PairEncoder, context: DistributedContext) -> nn.Module:
    """``encoder`` under DDP when there are several ranks (world size 1: itself). Buffers
    (position ids) are constants, synchronised once at construction, not at every forward."""
    if context.world_size == 1:
        return encoder
    device_ids = [context.local_rank] if torch.cuda.is_available() else None
    return DistributedDataParallel(encoder, device_ids=device_ids, forward_sync_buffers=False)


def unwrap(encoder: nn.Module) -> PairEncoder:
    inner = getattr(encoder, "module", encoder)  # DistributedDataParallel keeps it as .module
    if not isinstance(inner, PairEncoder):
        raise TypeError(f"expected a PairEncoder (or DDP of one), got {type(inner).__name__}")
    return inner


def backward_step(encoder: nn.Module, shard: RankShard, queries: Inputs, docs: Inputs,
                  context: DistributedContext, dual_weight: float,
                  autocast: Callable[[], AbstractContextManager],
                  grad_cache_chunk: int | None = None) -> tuple[float, float | None]:
    """Accumulate the gradients of this rank's share of the global loss into the parameters.

    ``encoder``: a :class:`PairEncoder`, wrapped in DDP when ``context`` has several ranks;
    ``queries``: this rank's queries then its negative queries (DANCE), tokenized;
    ``docs``: its positives then its hard negatives. Returns the global batch's loss and dual
    loss (None without DANCE), identical on every rank.
    """
    bare = unwrap(encoder)
    score = bare.model.score
    if grad_cache_chunk:
        return grad_cache_backward(encoder, bare, score, shard, queries, docs, context,
                                   dual_weight, autocast, grad_cache_chunk)
    with autocast():
        q, d = encoder(queries[0], queries[1], docs[0], docs[1])
    assert q is not None and d is not None
    parts = shard_loss(score, q, d, shard, context, dual_weight, autocast)
    parts.backward.backward()
    return global_losses(parts, shard, context, dual_weight)
