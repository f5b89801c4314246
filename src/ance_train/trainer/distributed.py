"""Data-parallel training math: N ranks train on one global batch as one process would.

``training.batch_size`` is the *global* batch. Every rank holds the same global
:class:`~ance_train.trainer.batches.TrainingBatch` and encodes only its slice of it
(:func:`shard_batch`): a contiguous range of queries with their positives, their hard
negatives and (DANCE) their negative queries. The allowed mask and the positive columns are
therefore those of the single-process batch, never rebuilt per rank, and no rank can disagree
with another about which column is whose positive. In the trainer, rank 0 — the only rank
that follows the negatives tables — builds each global batch and sends it to the others
(:func:`broadcast_object`: a few kilobytes of ids and masks per step), so a new table is
swapped in at the same step on every rank and a stop reaches all of them at once; the tests
build it on every rank from the same seeded builder instead, which gives the same batch.

The representations are gathered across ranks with gradients (:func:`gather_with_grad`):
forward an all-gather, backward an all-reduce of the gradient of the gathered matrix, each
rank keeping the rows it encoded. So every query scores the positives and hard negatives of
all ranks (in-batch negatives, as in DPR — Karpukhin et al., "Dense Passage Retrieval for
Open-Domain Question Answering", EMNLP 2020, arXiv 2004.04906 — and ANCE — Xiong et al.,
"Approximate Nearest Neighbor Negative Contrastive Learning for Dense Text Retrieval",
ICLR 2021, arXiv 2007.00808), and the gradient that another rank's loss sends to this rank's
documents reaches this rank's encoder.

The gathered rows come rank by rank — rank 0's positives, rank 0's negatives, rank 1's
positives, ... — while the batch's columns are all positives first, then all negatives.
:func:`shard_batch` gives the permutation that puts the gathered matrix back into the global
column order, so ``positive_column`` and ``allowed`` are the global batch's own. Getting this
wrong is silent: sentence-transformers shipped cross-device in-batch negatives (PR #3442)
whose label offsets, once hard negatives were in the batch, pointed queries of later ranks at
another query's hard negative — training anchors towards negatives — fixed by PR #3453.
``tests/test_distributed.py`` checks that every query's positive column holds its own positive
in the gathered matrix, and that a shifted offset changes the loss.

Scaling: rank r's loss is ``N · Σ_{i ∈ r} nll_i / B`` (N ranks, global batch B). The backward
of the gather sums the gradients of all ranks' losses into each rank's rows, and DDP averages
the parameter gradients over the N ranks, so the update is the gradient of the mean NLL over
the global batch — the single-process update (``tests/test_distributed.py`` compares the
losses and the weights after five steps). World size 1 is the trivial case of the same code:
no communication, the slice is the batch, the scale is ``1 / B``.

Process groups come from the environment torch's elastic launcher (``torch.distributed.run``)
sets: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``
(:func:`init_from_env`).
"""

from __future__ import annotations

import datetime
import itertools
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ance_train.trainer.batches import TrainingBatch
from ance_train.trainer.loss import contrastive_nll

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistributedContext:
    """This process's place among the data-parallel ranks (world size 1: no process group)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    # The group the representations are gathered on and the reported losses reduced on: a
    # group of its own, so that its collectives never interleave with DDP's gradient buckets.
    group: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")


def init_from_env(backend: str | None = None,
                  timeout: datetime.timedelta = datetime.timedelta(minutes=10),
                  ) -> DistributedContext:
    """Join the process group torchrun describes in the environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); without ``WORLD_SIZE`` (or at 1) this
    is a single process and no group is created. ``backend``: NCCL on CUDA, gloo otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistributedContext()
    missing = [name for name in ENV_VARS if name not in os.environ and name != "LOCAL_RANK"]
    if missing:
        raise RuntimeError(f"WORLD_SIZE is {world} but {', '.join(missing)} is not set: start "
                           "the trainer with torch.distributed.run (torchrun)")
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                timeout=timeout)
    return DistributedContext(rank=rank, world_size=world, local_rank=local_rank,
                              group=dist.new_group(backend=backend))


def launched_rank() -> int:
    """This process's ``RANK`` as torch's elastic launcher set it (0 when not launched so)."""
    return int(os.environ.get("RANK", "0"))


def broadcast_object(value: Any, context: DistributedContext) -> Any:
    """Rank 0's ``value`` on every rank (pickled; for small things: a batch, a flag)."""
    if context.world_size == 1:
        return value
    box = [value if context.is_main else None]
    dist.broadcast_object_list(box, src=0, group=context.group)
    return box[0]


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` rows over ``parts`` ranks, contiguous, the first ``total % parts`` one larger."""
    if parts < 1 or total < parts:
        raise ValueError(f"cannot split a global batch of {total} queries over {parts} ranks: "
                         "every rank needs at least one query")
    base, extra = divmod(total, parts)
    return [base + (r < extra) for r in range(parts)]


@dataclass
class RankShard:
    """One rank's slice of a global batch, with the global batch's masks for its rows.

    ``query_texts`` + ``dual_query_texts`` and ``doc_indices`` are what this rank encodes:
    its queries, then the negative queries of its positives (DANCE); its queries' positives,
    then their hard negatives. Gathering every rank's rows (rank order) and indexing with
    ``doc_order`` / ``query_order`` gives the global batch's document / query matrix.
    """

    rank: int
    world_size: int
    rows: range                      # the global rows (queries) of this rank
    global_size: int                 # B, the global batch
    query_texts: list[str]
    dual_query_texts: list[str]
    doc_indices: list[int]
    doc_counts: list[int]            # rows each rank contributes to the document gather
    query_counts: list[int]          # rows each rank contributes to the query gather
    doc_order: torch.Tensor | None   # gathered row of each global column (None: identity)
    query_order: torch.Tensor | None
    positive_column: torch.Tensor    # [local] global column of each local query's positive
    allowed: torch.Tensor            # [local, global docs]
    dual_allowed: torch.Tensor | None  # [local, global queries]
    doc_passages: list[int] = field(default_factory=list)  # MaxP: see TrainingBatch

    @property
    def size(self) -> int:
        return len(self.rows)


def _grouped_columns(start: int, counts: list[int], bounds: list[int]) -> list[np.ndarray]:
    """The columns of groups that follow one another from ``start`` (``counts[i]`` for row i),
    cut at the rank boundaries ``bounds``."""
    ends = start + np.cumsum([0, *counts])
    return [np.arange(ends[lo], ends[hi]) for lo, hi in itertools.pairwise(bounds)]


def _order(gathered_columns: np.ndarray) -> torch.Tensor | None:
    """Index that takes the gathered matrix (rows in ``gathered_columns`` order) to global
    column order; None when they coincide."""
    if np.array_equal(gathered_columns, np.arange(len(gathered_columns))):
        return None
    return torch.from_numpy(np.argsort(gathered_columns, kind="stable"))


def shard_batch(batch: TrainingBatch, rank: int, world_size: int) -> RankShard:
    """Rank ``rank``'s contiguous slice of the global ``batch`` (see the module docstring)."""
    size = len(batch.query_texts)
    sizes = split_sizes(size, world_size)
    bounds = [0, *np.cumsum(sizes).tolist()]
    negatives = batch.negatives_per_query or _counts(batch.hard_negatives, size)
    duals = batch.dual_per_query or _counts(len(batch.dual_query_texts), size)
    if len(negatives) != size or sum(negatives) != len(batch.doc_indices) - size:
        raise ValueError("the batch's negatives_per_query do not add up to its columns")
    if len(duals) != size or sum(duals) != len(batch.dual_query_texts):
        raise ValueError("the batch's dual_per_query do not add up to its negative queries")
    positive = [np.arange(lo, hi) for lo, hi in itertools.pairwise(bounds)]
    doc_parts = [np.concatenate([p, n]) for p, n in
                 zip(positive, _grouped_columns(size, negatives, bounds), strict=True)]
    query_parts = [np.concatenate([p, n]) for p, n in
                   zip(positive, _grouped_columns(size, duals, bounds), strict=True)]
    rows = range(bounds[rank], bounds[rank + 1])
    local_docs = doc_parts[rank]
    local_dual = query_parts[rank][len(rows):] - size
    return RankShard(
        rank=rank, world_size=world_size, rows=rows, global_size=size,
        query_texts=batch.query_texts[rows.start:rows.stop],
        dual_query_texts=[batch.dual_query_texts[i] for i in local_dual],
        doc_indices=[batch.doc_indices[c] for c in local_docs],
        doc_counts=[len(p) for p in doc_parts], query_counts=[len(p) for p in query_parts],
        doc_order=_order(np.concatenate(doc_parts)),
        query_order=_order(np.concatenate(query_parts)),
        positive_column=batch.positive_column[rows.start:rows.stop],
        allowed=batch.allowed[rows.start:rows.stop],
        dual_allowed=(None if batch.dual_allowed is None
                      else batch.dual_allowed[rows.start:rows.stop]),
        doc_passages=([batch.doc_passages[c] for c in local_docs] if batch.doc_passages
                      else []),
    )


def _counts(total: int, size: int) -> list[int]:
    """Per-query counts of a batch built without them: only unambiguous when there are none."""
    if total:
        raise ValueError("the batch does not say how many negatives each query has "
                         "(negatives_per_query / dual_per_query)")
    return [0] * size


class _GatherWithGrad(torch.autograd.Function):
    """All-gather of rows (ranks may hold different counts) whose backward sends each rank
    the sum over ranks of the gradient of its own rows."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, counts: list[int], rank: int,
                group: Any) -> torch.Tensor:
        ctx.counts, ctx.rank, ctx.group = counts, rank, group
        ctx.dtype = tensor.dtype
        # float32 on the wire: every backend moves it, and bf16/fp16 → fp32 → back is exact.
        padded = tensor.new_zeros((max(counts), *tensor.shape[1:]), dtype=torch.float32)
        padded[: tensor.shape[0]] = tensor.detach()
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)]).to(tensor.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        total = grad.detach().to(torch.float32).contiguous()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        start = sum(ctx.counts[: ctx.rank])
        return total[start: start + ctx.counts[ctx.rank]].to(ctx.dtype), None, None, None


def gather_with_grad(tensor: torch.Tensor, counts: list[int],
                     context: DistributedContext) -> torch.Tensor:
    """Every rank's rows of ``tensor`` (``counts[r]`` from rank r), concatenated in rank order,
    with the autograd graph kept for this rank's rows (world size 1: ``tensor`` itself)."""
    if context.world_size == 1:
        return tensor
    if tensor.shape[0] != counts[context.rank]:
        raise ValueError(f"rank {context.rank} holds {tensor.shape[0]} rows, "
                         f"its shard says {counts[context.rank]}")
    return _GatherWithGrad.apply(tensor, counts, context.rank, context.group)


def reorder(gathered: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    return gathered if order is None else gathered.index_select(0, order.to(gathered.device))


@dataclass
class ShardLoss:
    """``backward``: this rank's share of the loss, scaled for DDP's gradient average;
    ``local_nll`` / ``local_dual``: this rank's NLL sums (detached), for the report."""

    backward: torch.Tensor
    local_nll: torch.Tensor
    local_dual: torch.Tensor | None


def shard_loss(score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               queries: torch.Tensor, docs: torch.Tensor, shard: RankShard,
               context: DistributedContext, dual_weight: float,
               autocast: Callable[[], AbstractContextManager]) -> ShardLoss:
    """ANCE's NLL over the global batch (+ λ × DANCE's dual NLL, Eq. 12 of Li et al., "More
    Robust Dense Retrieval with Contrastive Dual Learning", ICTIR 2021, arXiv 2107.07773) for
    this rank's queries, from this rank's representations: ``queries`` are its queries then its
    negative queries, ``docs`` its positives then its hard negatives."""
    device = docs.device
    with autocast():
        all_docs = reorder(gather_with_grad(docs, shard.doc_counts, context), shard.doc_order)
        scores = score(queries[: shard.size], all_docs)
        dual_scores = None
        if shard.dual_allowed is not None:
            all_queries = reorder(gather_with_grad(queries, shard.query_counts, context),
                                  shard.query_order)
            dual_scores = score(docs[: shard.size], all_queries)
    positive = shard.positive_column.to(device)
    nll = contrastive_nll(scores, positive, shard.allowed.to(device), reduction="sum")
    scale = context.world_size / shard.global_size
    loss = nll * scale
    dual = None
    if dual_scores is not None:
        assert shard.dual_allowed is not None
        dual = contrastive_nll(dual_scores, positive, shard.dual_allowed.to(device),
                               reduction="sum")
        loss = loss + dual_weight * (dual * scale)
    return ShardLoss(loss, nll.detach(), None if dual is None else dual.detach())


def global_losses(parts: ShardLoss, shard: RankShard, context: DistributedContext,
                  dual_weight: float) -> tuple[float, float | None]:
    """The global batch's loss and dual loss (means over its B queries), the same on every
    rank: one all-reduce of two numbers (not a gradient all-reduce)."""
    if context.world_size == 1:
        dual = None if parts.local_dual is None else float(parts.local_dual) / shard.global_size
        return float(parts.backward.detach()), dual
    sums = torch.stack([parts.local_nll.float(),
                        torch.zeros((), device=parts.local_nll.device) if parts.local_dual is None
                        else parts.local_dual.float()])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=context.group)
    nll, dual = (float(v) / shard.global_size for v in sums)
    if parts.local_dual is None:
        return nll, None
    return nll + dual_weight * dual, dual
