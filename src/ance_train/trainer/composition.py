"""The Trainer's composition root: every collaborator of a trainer process, built once from its
:class:`~ance_train.runtime.ServiceContext`, in dependency order, so that
:mod:`ance_train.trainer.trainer` holds the training loop only.

The order matters where one part needs another: the distributed context comes first (the
device, the seeds and who resumes from which checkpoint depend on it), then the checkpoint to
start from (the model and tokenizer come from it), then what trains the model, then the
negatives (the feed, the picker, the tables the indexer must keep), then reporting.
"""

from __future__ import annotations

import datetime
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import get_linear_schedule_with_warmup

from ance_train.infra.bus import WorkQueue
from ance_train.infra.retention import RunRetention
from ance_train.modeling.model import BiEncoder, load_tokenizer
from ance_train.modeling.passages import PassageSplitter
from ance_train.modeling.source import base_model_dir
from ance_train.negatives.strategies.random import RandomNegatives
from ance_train.observability.telemetry import TrainerTelemetry
from ance_train.observability.tracking import Tracking, open_tracking
from ance_train.runtime import ServiceContext
from ance_train.trainer.batches import BatchBuilder
from ance_train.trainer.checkpoints import CheckpointPublisher, latest_complete_checkpoint
from ance_train.trainer.core_sharing import RefreshAwareThreads
from ance_train.trainer.distributed import DistributedContext, broadcast_object, init_from_env
from ance_train.trainer.early_stopping import EarlyStopping
from ance_train.trainer.interpolation import StartInterpolation
from ance_train.trainer.negative_sources import NegativesPicker
from ance_train.trainer.negatives_feed import NegativesFeed, TablesAnnouncer
from ance_train.trainer.prefetch import BatchPreparer
from ance_train.trainer.step import PairEncoder, data_parallel

if TYPE_CHECKING:
    from ance_train.negatives.strategies.dance import DanceLoss

# Rank 0 may wait long for the first negatives, or save a checkpoint, while the other ranks
# wait for its next batch.
RANK_TIMEOUT = datetime.timedelta(hours=6)


@dataclass
class TrainerParts:
    """What a trainer process trains with (see the module docstring for the order)."""

    dist: DistributedContext
    device: torch.device
    threads: RefreshAwareThreads | None  # training.torch_threads_between_refreshes
    early: EarlyStopping | None          # training.early_stopping (rank 0)
    queue: WorkQueue
    publisher: CheckpointPublisher
    resumed_from: int | None             # the checkpoint every rank resumes from
    model_dir: Path                      # where the model (and training state) was read
    tokenizer: Any
    model: BiEncoder
    interpolation: StartInterpolation | None  # training.wise_ft_alpha < 1 (rank 0 publishes)
    preparer: BatchPreparer
    encoder: torch.nn.Module             # DDP over the pair encoder with several ranks
    optimizer: torch.optim.Optimizer
    scheduler: Any
    batches: BatchBuilder
    feed: NegativesFeed
    picker: NegativesPicker
    dance: DanceLoss
    tables: TablesAnnouncer
    retention: RunRetention
    telemetry: TrainerTelemetry
    tracking: Tracking


def distributed_context(processes: int) -> DistributedContext:
    """One process, or this rank of ``processes`` started by torch.distributed.run."""
    if processes == 1:
        return DistributedContext()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != processes:
        raise RuntimeError(
            f"training.processes is {processes} but WORLD_SIZE is {world}: start the trainer "
            f"with python -m torch.distributed.run --nproc-per-node {processes} -m "
            "ance_train.cli serve trainer ... (ance-train run does)")
    return init_from_env(timeout=RANK_TIMEOUT)


def build_parts(ctx: ServiceContext, current_step: Callable[[], int]) -> TrainerParts:
    """Every collaborator of the trainer of ``ctx``; ``current_step``: the loop's step (what
    the tables announcer reports the tables in use at)."""
    cfg = ctx.config
    # Data-parallel ranks (training.processes, started by torch.distributed.run): rank 0 is
    # the trainer the other services see — it picks the negatives, builds each global batch
    # and sends it to the others, checkpoints, announces and writes the summary; the other
    # ranks only compute their slice of every step (``Trainer._follow``).
    dist = distributed_context(cfg.training.processes)
    # Rank r draws its own dropout masks (seed + r; rank 0 as a single process would).
    torch.manual_seed(cfg.training.seed + dist.rank)
    random.seed(cfg.training.seed)
    if cfg.training.torch_threads:
        torch.set_num_threads(cfg.training.torch_threads)
    between = cfg.training.torch_threads_between_refreshes
    threads = (None if between is None else RefreshAwareThreads(
        ctx.bus, torch.get_num_threads(), between, torch.set_num_threads, ctx.stop))
    # training.early_stopping: derived from the eval reports in the store (rank 0 reads).
    stopping = cfg.training.early_stopping
    early = (None if stopping is None or not dist.is_main
             else EarlyStopping(stopping, ctx.store, ctx.bus, ctx.stop))
    device = (torch.device("cuda" if torch.cuda.is_available() else "cpu")
              if dist.world_size == 1 else dist.device())
    queue = WorkQueue(ctx.bus, cfg.inference.claim_timeout_s)
    publisher = CheckpointPublisher(ctx.store, ctx.bus, queue, cfg, ctx.dataset, ctx.work_dir)
    # Every rank resumes from the checkpoint rank 0 found (not from one rank 0 wrote since).
    resumed_from = broadcast_object(latest_complete_checkpoint(ctx.store), dist)
    if resumed_from is not None:
        ctx.log.info("resuming from checkpoint %d", resumed_from)
        model_dir = publisher.fetch(resumed_from)
    else:  # model.path, or the run's stored copy of a Hub / s3:// model (modeling/source)
        model_dir = base_model_dir(cfg.model, ctx.store, ctx.work_dir / "base-model")
    tokenizer = load_tokenizer(model_dir)
    model = BiEncoder.from_pretrained(model_dir, cfg.model).to(device)
    alpha = cfg.training.wise_ft_alpha_for(ctx.dataset.trainable_queries)
    interpolation = (StartInterpolation.for_run(model, alpha, ctx.store, ctx.work_dir,
                                                resumed_from is not None)
                     if dist.is_main else None)
    # Reads and tokenises the next batch while a step computes; its own tokenizer (the loop's
    # thread saves ``tokenizer`` into checkpoints meanwhile).
    batch_tokenizer = load_tokenizer(model_dir)
    preparer = BatchPreparer(
        batch_tokenizer, ctx.corpus, cfg.model.max_query_length, cfg.model.max_doc_length,
        dist.rank, dist.world_size, query_prompt=model.query_prompt,
        document_prompt=model.document_prompt,
        passages=(PassageSplitter(batch_tokenizer, cfg.data.passages,
                                  cfg.model.max_doc_length, model.document_prompt)
                  if cfg.data.passages.enabled else None))
    encoder = data_parallel(PairEncoder(model), dist)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.training.learning_rate,
                                  weight_decay=cfg.training.weight_decay)
    scheduler = get_linear_schedule_with_warmup(optimizer, cfg.training.warmup_steps,
                                                cfg.training.total_steps)
    batches = BatchBuilder(ctx.dataset, cfg.training.batch_size, cfg.negatives.per_query,
                           cfg.training.in_batch_negatives, cfg.training.seed)
    # DANCE's dual loss (off at weight 0); the cast: the registry's "dance" is DanceLoss.
    dance = cast("DanceLoss", cfg.negatives.strategy("dance"))
    tables: TablesAnnouncer | None = None  # announces on each swap of the feed (below)

    def announce_tables() -> None:
        assert tables is not None  # built before the feed starts and can swap
        tables.announce()

    feed = NegativesFeed(ctx.bus, ctx.store, ctx.options.instance, ctx.stop,
                         on_swap=announce_tables, cache_dir=ctx.work_dir)  # tables: negatives/
    picker = NegativesPicker(cfg.negatives, feed,
                             RandomNegatives(ctx.dataset.num_docs, batches.positives))
    # negatives.in_use: which refresh objects the indexer must keep for this trainer.
    tables = TablesAnnouncer(ctx.bus, feed, cfg.negatives.mines_ann or dance.enabled,
                             current_step)
    return TrainerParts(
        dist=dist, device=device, threads=threads, early=early, queue=queue,
        publisher=publisher, resumed_from=resumed_from, model_dir=model_dir,
        tokenizer=tokenizer, model=model, interpolation=interpolation, preparer=preparer,
        encoder=encoder, optimizer=optimizer,
        scheduler=scheduler, batches=batches, feed=feed, picker=picker, dance=dance,
        tables=tables,
        # store.keep_checkpoints: the trainer alone deletes checkpoints (infra/retention.py).
        retention=RunRetention(ctx.bus, ctx.store, None, cfg.store.keep_checkpoints),
        telemetry=TrainerTelemetry(ctx.reporter, cfg.training.total_steps, dist.world_size),
        # Rank 0 alone reports, as it alone checkpoints and writes the summary.
        tracking=(open_tracking(cfg, "trainer", ctx.store, ctx.work_dir) if dist.is_main
                  else Tracking([])))
