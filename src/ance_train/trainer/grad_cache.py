"""GradCache: the contrastive loss of a large batch at the memory cost of a small chunk.

Gao, Zhang, Han and Callan, "Scaling Deep Contrastive Learning Batch Size under Memory
Limited Setup", RepL4NLP 2021, arXiv 2101.06983. The loss of a bi-encoder couples every query
with every document only through their representations, so its gradient factorises:

1. encode the batch chunk by chunk *without* the autograd graph (representation cache);
2. compute the loss on the whole batch — across ranks, as :mod:`.distributed` gathers it —
   and its gradient with respect to the cached representations (gradient cache);
3. re-encode each chunk *with* the graph and back-propagate its cached gradient; the
   parameter gradients accumulate to those of the full-batch backward.

Peak activation memory is that of one chunk instead of the batch, at the price of a second
forward pass. Two traps (tested in ``tests/test_grad_cache.py`` and, the all-reduce count,
``tests/test_distributed.py``):

* dropout: the re-forward must draw the same masks as the first forward, or the cached
  gradient belongs to other representations. The torch RNG state (CPU, and the device's CUDA
  generator) is saved before each chunk's first forward and restored before its re-forward;
  afterwards the RNG is where the uncached step would have left it.
* DDP: each chunk's backward would all-reduce the gradients (sentence-transformers #4027).
  All but the last chunk run under ``model.no_sync()``: one gradient all-reduce per step.

Mixed precision: both passes run under the same autocast context; the cached gradients have
the representations' dtype, and the loss is computed in float32 (:func:`contrastive_nll`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from ance_train.trainer.distributed import (
    DistributedContext,
    RankShard,
    global_losses,
    shard_loss,
)

Inputs = tuple[torch.Tensor, torch.Tensor]  # input_ids, attention_mask
RngState = tuple[torch.Tensor, torch.Tensor | None]


def rng_state(device: torch.device) -> RngState:
    """The generators dropout draws from on ``device``: torch's CPU one, and CUDA's."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: RngState, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def chunks(rows: int, size: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + size, rows)) for lo in range(0, rows, size)]


def grad_cache_backward(encoder: nn.Module, bare: nn.Module,
                        score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                        shard: RankShard, queries: Inputs, docs: Inputs,
                        context: DistributedContext, dual_weight: float,
                        autocast: Callable[[], AbstractContextManager],
                        chunk: int) -> tuple[float, float | None]:
    """Accumulate the step's gradients into the parameters, ``chunk`` rows at a time.

    ``encoder`` is the :class:`~ance_train.trainer.step.PairEncoder` the step trains through
    (DDP-wrapped when there are several ranks), ``bare`` the unwrapped one (the cache pass
    needs no gradient synchronisation). Returns the global loss and dual loss.
    """
    if chunk < 1:
        raise ValueError(f"grad_cache_chunk must be at least 1, not {chunk}")
    device = queries[0].device
    # Queries first, then documents: with a chunk as large as the batch the RNG is consumed
    # exactly as by the uncached step (same dropout masks, same state afterwards).
    pieces = ([("q", lo, hi) for lo, hi in chunks(len(queries[0]), chunk)]
              + [("d", lo, hi) for lo, hi in chunks(len(docs[0]), chunk)])
    inputs = {"q": queries, "d": docs}
    states: list[RngState] = []
    cached: dict[str, list[torch.Tensor]] = {"q": [], "d": []}
    with torch.no_grad():
        for kind, lo, hi in pieces:
            states.append(rng_state(device))
            with autocast():
                cached[kind].append(_encode(bare, kind, inputs[kind], lo, hi))
    after = rng_state(device)
    q = torch.cat(cached["q"]).requires_grad_()
    d = torch.cat(cached["d"]).requires_grad_()
    parts = shard_loss(score, q, d, shard, context, dual_weight, autocast)
    parts.backward.backward()
    grads = {"q": _grad(q), "d": _grad(d)}
    no_sync = getattr(encoder, "no_sync", None)
    for k, (kind, lo, hi) in enumerate(pieces):
        set_rng_state(states[k], device)
        last = k == len(pieces) - 1
        with nullcontext() if last or no_sync is None else no_sync():
            with autocast():
                out = _encode(encoder, kind, inputs[kind], lo, hi)
            out.backward(grads[kind][lo:hi])
    set_rng_state(after, device)
    return global_losses(parts, shard, context, dual_weight)


def _grad(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)


def _encode(encoder: nn.Module, kind: str, inputs: Inputs, lo: int, hi: int) -> torch.Tensor:
    ids, mask = inputs[0][lo:hi], inputs[1][lo:hi]
    q, d = encoder(ids, mask, None, None) if kind == "q" else encoder(None, None, ids, mask)
    return q if kind == "q" else d
