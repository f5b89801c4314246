"""The Trainer service: optimises the bi-encoder on the freshest negatives available.

Per step it takes the negatives the configured strategy calls for from what the feed holds
(never waiting, except before step 1 when ``negatives.wait_for_first`` says so), computes the
NLL loss over the positive, hard and in-batch negatives (plus λ × DANCE's dual
query-retrieval loss when enabled), and every ``refresh_every`` steps saves a checkpoint that
the publisher uploads and announces in the background. It records the async gap (current
step − step of the checkpoint whose negatives are in use, ANCE §6.4) and, at an interval,
the gradient norms of the bottom / middle / top layers (ANCE Fig. 4).

A restarted trainer resumes from the newest complete checkpoint of its run: weights,
optimizer, scheduler, RNG states, batch position, negatives tables and summary records come
back as they were at that step (:mod:`.training_state`); the checkpoint is not republished.

With ``training.processes`` N (started by ``torch.distributed.run``) the step is computed by N
data-parallel ranks (:mod:`.distributed`, :mod:`.step`, :mod:`.grad_cache`): rank 0 runs the
loop above and sends each global batch to the others, which follow (:meth:`Trainer._follow`).

Batch s+1 is built and sent before step s is optimised, and every rank reads and tokenises its
slice of it on a background thread while step s computes (:mod:`.prefetch`).
"""

from __future__ import annotations

import functools
import os
import signal
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, fields
from typing import Any, cast

import torch

from ance_train.config import budget_summary, dump_config
from ance_train.infra.bus import REDIS_UNAVAILABLE
from ance_train.infra.process import die_with_parent
from ance_train.infra.store import StorageError
from ance_train.modeling.precision import autocast_context
from ance_train.observability.timeline import swap_scalars
from ance_train.protocol import keys
from ance_train.protocol.events import RunFinished, ShardFailed
from ance_train.runtime import ServiceContext
from ance_train.trainer.batches import TrainingBatch
from ance_train.trainer.composition import TrainerParts, build_parts
from ance_train.trainer.distributed import (
    broadcast_object,
    launched_rank,
)
from ance_train.trainer.interpolation import load_weights
from ance_train.trainer.loss import layer_grad_norms
from ance_train.trainer.prefetch import PlannedBatch, StepInputs
from ance_train.trainer.step import backward_step
from ance_train.trainer.training_state import (
    NegativesInUse,
    TrainingState,
    capture_rng,
    restore_rng,
)


@dataclass
class TrainingRecord:
    """What the run's summary reports about training (also read by the tests)."""

    losses: list[float] = field(default_factory=list)
    dual_losses: list[float | None] = field(default_factory=list)
    hard_negatives: list[int] = field(default_factory=list)
    grad_norms: list[dict] = field(default_factory=list)
    async_gaps: list[int | None] = field(default_factory=list)
    negatives_steps: list[int | None] = field(default_factory=list)
    swaps: list[dict] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    negatives_ms: list[float] = field(default_factory=list)
    # Reading + tokenising each step's batch on the prefetch thread, and how long the step
    # still waited for it (near 0 when it was hidden behind the previous step).
    prepare_ms: list[float] = field(default_factory=list)
    prepare_wait_ms: list[float] = field(default_factory=list)
    wait_before_first_s: float = 0.0
    checkpoints: list[int] = field(default_factory=list)
    resumed_from: list[int] = field(default_factory=list)
    torch_threads: list[int] = field(default_factory=list)  # each step's (core_sharing.py)

    @classmethod
    def from_dict(cls, values: dict) -> TrainingRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


class Trainer:
    def __init__(self, ctx: ServiceContext, parts: TrainerParts | None = None) -> None:
        """The loop over ``parts``, the collaborators :func:`build_parts` makes (the
        composition root) unless given."""
        self.ctx = ctx
        self.cfg = ctx.config
        self.step = 0
        p = parts if parts is not None else build_parts(ctx, lambda: self.step)
        self.dist, self.device, self.threads, self.early = p.dist, p.device, p.threads, p.early
        self.queue, self.publisher, self.resumed_from = p.queue, p.publisher, p.resumed_from
        self.tokenizer, self.model, self.preparer = p.tokenizer, p.model, p.preparer
        self.interpolation = p.interpolation  # training.wise_ft_alpha (rank 0)
        self.encoder, self.optimizer, self.scheduler = p.encoder, p.optimizer, p.scheduler
        self.batches, self.feed, self.picker, self.dance = p.batches, p.feed, p.picker, p.dance
        self.tables, self.retention = p.tables, p.retention
        self.telemetry, self.tracking = p.telemetry, p.tracking
        self.stopped_early: dict | None = None  # summary's stopped_early
        self.store_bytes: int | None = None  # the run's store size at the last checkpoint
        self.record = TrainingRecord()
        self.in_use_step: int | None = None  # step of the negatives table the last step used
        self.first_step = 1  # the first step this process runs (logged)
        self._lookahead: PlannedBatch | None = None  # batch of step + 1 of the checkpoint
        self._resume_state = (None if self.resumed_from is None
                              else self._restore(TrainingState.load(p.model_dir)))

    def _restore(self, state: TrainingState) -> TrainingState:
        """Optimizer, scheduler, batch position and records of a checkpoint (the RNG states
        and the negatives tables are restored by ``run``, right before the loop)."""
        if state.trained_weights is not None:  # the model files hold a blend (.interpolation)
            load_weights(self.model, state.trained_weights)
        self.optimizer.load_state_dict(state.optimizer)
        self.scheduler.load_state_dict(state.scheduler)
        self.batches.load_state_dict(state.batches)
        self.record = TrainingRecord.from_dict(state.record)
        self.record.resumed_from.append(state.step)
        self.step = state.step
        self.in_use_step = state.negatives.in_use
        if state.lookahead is not None:
            self._lookahead = PlannedBatch.from_state(state.lookahead)
            if self._lookahead.step != state.step + 1:
                raise ValueError(f"checkpoint {state.step}: its lookahead batch is for step "
                                 f"{self._lookahead.step}, not {state.step + 1}")
        return state

    def _abandoned(self) -> ShardFailed | None:
        """The ``shard.failed`` of the checkpoint the first negatives must come from, if any."""
        return next((r.event for r in self.ctx.bus.history(ShardFailed)
                     if r.event.step == self.step), None)

    def run(self) -> TrainingRecord:
        if not self.dist.is_main:
            return self._follow()
        try:
            return self._run()
        finally:
            self.tracking.close()

    def _run(self) -> TrainingRecord:
        """Rank 0: the run's start (checkpoint 0 or the resumed one, the first negatives),
        its steps, its end (summary, ``run.finished``)."""
        self._start()
        try:
            self._loop()
        finally:
            self.preparer.close()
        return self._finish()

    def _start(self) -> None:
        """Checkpoint 0 (or the restored checkpoint's tables and RNG states), the feed and the
        helpers started, and the first negatives waited for when the strategy says so."""
        ctx, cfg = self.ctx, self.cfg
        ctx.store.put_bytes(keys.RUN_CONFIG, dump_config(cfg).encode())
        self.telemetry.started()
        ctx.state.update(state="running", phase=f"checkpoint {self.step}",
                         total=cfg.training.total_steps, step=self.step, done=self.step)
        if self._resume_state is None:
            self._checkpoint(0)
        else:
            held = self._resume_state.negatives
            self.tables.checkpoint_saved(self.step, (held.ann, held.dual))
            self.publisher.ensure_announced(self.step)
            if self.threads is not None:
                self.threads.checkpoint_saved(self.step)
            self.feed.restore(held)
        self.tables.announce()
        self.feed.start()
        if self.threads is not None:
            self.threads.start()
        if self.early is not None:
            self.early.start(self.step)
        if self.picker.needs_wait():
            ctx.state.update(phase="waiting for first negatives")
            started = time.monotonic()
            self.feed.wait_until(lambda: self.picker.ready() or self._abandoned() is not None)
            self.record.wait_before_first_s += time.monotonic() - started
            self.feed.check()
            abandoned = self._abandoned()
            if not self.picker.ready() and abandoned is not None:
                raise RuntimeError(
                    f"no first negatives: checkpoint {self.step} was abandoned because "
                    f"{abandoned.key} could not be encoded "
                    f"({abandoned.error}); with negatives.pool "
                    f"{cfg.negatives.pool} and no BM25 warm-up there is nothing to train on")
        if self._resume_state is not None:  # last: nothing may draw before the loop
            self._restore_rank_rng(self._resume_state.rng)
        self.first_step = self.step + 1

    def _loop(self) -> None:
        """The steps, up to the budget, a stop or an early stop."""
        ctx, cfg = self.ctx, self.cfg
        dual_weight = self.dance.weight
        # One-batch lookahead (.prefetch): batch s+1 is built and sent before step s trains.
        upcoming = (self._lookahead or self._plan(self.step + 1)
                    if self.step < cfg.training.total_steps and not ctx.stop.is_set()
                    and not self._stopping() else None)
        broadcast_object(upcoming, self.dist)
        pending = None if upcoming is None else self.preparer.submit(upcoming)
        while True:
            if (upcoming is None or self.step >= cfg.training.total_steps
                    or ctx.stop.is_set()):
                broadcast_object(None, self.dist)  # the other ranks stop here too
                break
            self.feed.check()
            self.step += 1
            started = time.monotonic()
            current, inputs = upcoming, pending
            # Early stopping: this step is the last; it is checkpointed on every rank.
            final = self.step < cfg.training.total_steps and self._stopping()
            upcoming = (self._plan(self.step + 1)
                        if self.step < cfg.training.total_steps and not final else None)
            broadcast_object(_Next(upcoming, final), self.dist)
            pending = None if upcoming is None else self.preparer.submit(upcoming)
            if current.table_step is not None and current.table_step != self.in_use_step:
                self._swapped(current.table_step)
            self.record.torch_threads.append(
                torch.get_num_threads() if self.threads is None
                else self.threads.before_step())
            assert inputs is not None  # submitted with ``current``, which is not None
            loss, dual_loss = self._optimise(current.batch, self.preparer.result(inputs),
                                             dual_weight)
            # Async gap: steps since the checkpoint that mined the table in use (ANN only).
            gap = None if current.mined_at is None else self.step - current.mined_at
            self.record.dual_losses.append(dual_loss)
            self.record.hard_negatives.append(current.batch.hard_negatives)
            self._log_step(loss, gap, current.table_step, current.negatives_ms,
                           time.monotonic() - started)
            if cfg.training.is_checkpoint_step(self.step) or final:
                self._checkpoint(self.step, upcoming)

    def _finish(self) -> TrainingRecord:
        """Every upload done, the early stop recorded, the summary written and, at the
        run's end, ``run.finished`` published (once)."""
        ctx, cfg = self.ctx, self.cfg
        self.publisher.flush()
        self.publisher.close()
        if self.early is not None and self.early.decision.stop and (
                self.step < cfg.training.total_steps):
            decision = self.early.decision
            assert cfg.training.early_stopping is not None  # what ``self.early`` was built from
            self.stopped_early = {"at_step": self.step, "best_step": decision.best_step,
                                  "best_value": decision.best_value,
                                  "metric": cfg.training.early_stopping.metric,
                                  "decided_at": decision.decided_at}
            ctx.log.info("stopped early at step %d: best dev %s %.4f at checkpoint %d",
                         self.step, self.stopped_early["metric"], decision.best_value,
                         decision.best_step)
        finished = self.step >= cfg.training.total_steps or self.stopped_early is not None
        try:
            self._update_store_bytes()
        except StorageError as error:  # the summary keeps the last size listed
            ctx.log.warning("listing the store's size failed: %s", error)
        ctx.store.put_json(keys.TRAINER_SUMMARY, self.summary(finished))
        if finished:
            # A trainer killed after announcing the end is restarted on its final checkpoint
            # (the launcher's supervisor, a Kubernetes Job): it finishes again, silently.
            if not any(r.event.step == self.step for r in ctx.bus.history(RunFinished)):
                ctx.bus.publish(RunFinished(step=self.step))
            self.telemetry.finished(self.step)
        ctx.state.update(state="finished" if finished else "stopped", phase="done")
        return self.record

    def _stopping(self) -> bool:
        """Whether training.early_stopping has decided to end the run (rank 0)."""
        return self.early is not None and self.early.decision.stop

    def _swapped(self, table_step: int) -> None:
        """The step about to train is the first on the table of ``table_step`` (-1: BM25):
        recorded with the feed's times (the refresh timeline's last rows, also tracked at
        global step = the table's checkpoint step)."""
        swap: dict[str, float] = {"step": self.step, "negatives_step": table_step}
        times = self.feed.swap_times.get(table_step)
        if times is not None:
            swap.update(times, used_at=time.time())
            self.tracking.scalars(table_step, swap_scalars(swap))
        self.record.swaps.append(swap)
        self.in_use_step = table_step

    def _plan(self, step: int) -> PlannedBatch:
        """Global batch ``step`` on the negatives held now (rank 0)."""
        started = time.monotonic()
        source, table = self.picker.pick(step)
        dual = self.dance.source(self.feed)
        passages = self.feed.ann if self.ctx.config.data.passages.enabled else None
        batch = self.batches.build(source, dual, self.dance.per_positive, passages)
        return PlannedBatch(step=step, batch=batch,
                            table_step=None if table is None else table.reported_step,
                            mined_at=None if table is None else table.step,
                            negatives_ms=(time.monotonic() - started) * 1000)

    def _follow(self) -> TrainingRecord:
        """A rank other than 0: train on the global batches rank 0 sends (so negatives swap at
        the same step on every rank) until it sends None. Rank 0 alone checkpoints, announces
        and reports; this rank's record holds its view of the losses (the global ones)."""
        cfg = self.cfg
        self.ctx.state.update(state="running", phase=f"rank {self.dist.rank}",
                              total=cfg.training.total_steps, step=self.step)
        if self._resume_state is None:
            self._gather_rng()  # rank 0 saves checkpoint 0
        else:
            self._restore_rank_rng(self._resume_state.rng)
        # Rank 0 sends the first batch, then per step the batch after it (_Next), or None.
        upcoming: PlannedBatch | None = broadcast_object(None, self.dist)
        pending = None if upcoming is None else self.preparer.submit(upcoming)
        try:
            while (order := broadcast_object(None, self.dist)) is not None:
                if upcoming is None or pending is None:
                    raise RuntimeError(f"rank {self.dist.rank}: rank 0 ordered step "
                                       f"{self.step + 1} but sent no batch for it")
                self.step += 1
                current, inputs = upcoming, pending
                upcoming = order.batch
                pending = None if upcoming is None else self.preparer.submit(upcoming)
                loss, dual_loss = self._optimise(current.batch, self.preparer.result(inputs),
                                                 self.dance.weight)
                self.record.losses.append(loss)
                self.record.dual_losses.append(dual_loss)
                self.ctx.state.update(step=self.step, done=self.step, metrics={"loss": loss})
                if cfg.training.is_checkpoint_step(self.step) or order.final:
                    self._gather_rng()  # rank 0 saves a checkpoint
        finally:
            self.preparer.close()
        self.ctx.state.update(state="finished", phase="done")
        return self.record

    def _optimise(self, batch: TrainingBatch, inputs: StepInputs,
                  dual_weight: float) -> tuple[float, float | None]:
        """One optimiser step on this rank's slice of the global batch (the whole batch in a
        single process), tokenised ahead in ``inputs``: the loss over the global batch, its
        gradient (cached in chunks with ``training.grad_cache_chunk``), clipping, the
        update."""
        cfg = self.cfg
        self.model.train()
        self.record.prepare_ms.append(inputs.prepare_ms)
        self.record.prepare_wait_ms.append(inputs.wait_ms)
        self.optimizer.zero_grad(set_to_none=True)
        loss, dual_loss = backward_step(
            self.encoder, inputs.shard,
            (inputs.query_ids.to(self.device), inputs.query_mask.to(self.device)),
            (inputs.doc_ids.to(self.device), inputs.doc_mask.to(self.device)),
            self.dist, dual_weight if batch.dual_allowed is not None else 0.0,
            functools.partial(autocast_context, cfg.training.mixed_precision, self.device),
            cfg.training.grad_cache_chunk)
        every = cfg.negatives.grad_norm_every
        if every and (self.step % every == 0 or self.step == 1):
            self.record.grad_norms.append({"step": self.step,
                                           **layer_grad_norms(self.model.encoder)})
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.training.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        return loss, dual_loss

    def _log_step(self, loss: float, gap: int | None, negatives_step: int | None,
                  negatives_ms: float, seconds: float) -> None:
        rec = self.record
        rec.losses.append(loss)
        rec.async_gaps.append(gap)
        rec.negatives_steps.append(negatives_step)
        rec.negatives_ms.append(negatives_ms)
        rec.step_seconds.append(seconds)
        metrics = {"loss": loss, "step_seconds": seconds, "negatives_ms": negatives_ms,
                   "learning_rate": self.scheduler.get_last_lr()[0]}
        if gap is not None:
            metrics["async_gap"] = gap
        self.ctx.state.update(step=self.step, done=self.step, phase="training",
                              index_step=-1 if negatives_step is None else negatives_step,
                              metrics=metrics)
        self.telemetry.step(self.step, loss, negatives_step, gap)
        self._track(metrics, negatives_step)
        if self.step % 10 == 0 or self.step in (1, self.first_step):
            self.ctx.log.info("step %d loss %.4f gap %s (%.2fs)", self.step, loss, gap, seconds)

    def _track(self, metrics: dict, negatives_step: int | None) -> None:
        """The step's scalars for TensorBoard / W&B / MLflow (queued, never waited on)."""
        rec = self.record
        scalars = {"train/loss": metrics["loss"],
                   "train/learning_rate": metrics["learning_rate"],
                   "time/step_seconds": metrics["step_seconds"],
                   "time/negatives_ms": metrics["negatives_ms"]}
        if rec.dual_losses and rec.dual_losses[-1] is not None:
            scalars["train/dual_loss"] = rec.dual_losses[-1]
        if "async_gap" in metrics:
            scalars["negatives/async_gap"] = metrics["async_gap"]
        if negatives_step is not None:
            scalars["negatives/step"] = negatives_step  # -1: BM25
            if rec.swaps:  # steps trained on the table in use since it was swapped in
                scalars["negatives/age_steps"] = self.step - rec.swaps[-1]["step"]
        if rec.grad_norms and rec.grad_norms[-1]["step"] == self.step:
            scalars.update({f"grad_norm/{layer}": norm for layer, norm
                            in rec.grad_norms[-1].items() if layer != "step"})
        self.tracking.scalars(self.step, scalars)

    def _gather_rng(self) -> dict | None:
        """Every rank's RNG states, on rank 0, as a checkpoint stores them: rank 0's, with the
        other ranks' under ``"ranks"`` (one process: just its own). All ranks call it at each
        checkpoint step."""
        own = capture_rng()
        if self.dist.world_size == 1:
            return own
        states: list = [None] * self.dist.world_size
        torch.distributed.all_gather_object(states, own, group=self.dist.group)
        return {**own, "ranks": states} if self.dist.is_main else None

    def _restore_rank_rng(self, rng: dict) -> None:
        """A resumed rank's RNG states: its own from the checkpoint (rank 0's if the
        checkpoint was written by a different number of ranks)."""
        ranks = rng.get("ranks")
        if self.dist.world_size == 1:
            restore_rng(rng)
        elif ranks is not None and len(ranks) == self.dist.world_size:
            restore_rng(ranks[self.dist.rank])
        else:
            self.ctx.log.warning("checkpoint holds no RNG state for rank %d of %d: using "
                                 "rank 0's", self.dist.rank, self.dist.world_size)
            restore_rng(rng)

    def _checkpoint(self, step: int, lookahead: PlannedBatch | None = None) -> None:
        """Save (then publish in the background) the weights and the training state after
        ``step``; ``lookahead``: the batch of step + 1, already built (.prefetch)."""
        self.record.checkpoints.append(step)
        feed = self.feed
        state = TrainingState(
            step=step, optimizer=self.optimizer.state_dict(),
            scheduler=self.scheduler.state_dict(),
            # The cast: rank 0 alone checkpoints (the others _follow); its states are never None.
            rng=cast("dict[str, Any]", self._gather_rng()),
            batches=self.batches.state_dict(),
            negatives=NegativesInUse(
                ann=None if feed.ann is None else feed.ann.step,
                dual=None if feed.dual is None else feed.dual.step,
                bm25=feed.bm25 is not None, in_use=self.in_use_step),
            record=asdict(self.record),
            lookahead=None if lookahead is None else lookahead.state_dict())
        self.tables.checkpoint_saved(step, (state.negatives.ann, state.negatives.dual))
        if self.threads is not None:
            self.threads.checkpoint_saved(step)
        if self.interpolation is None:
            upload = self.publisher.publish(step, self.model, self.tokenizer, state)
        else:  # the model files hold θ0 + α (θ − θ0), the state θ
            with self.interpolation.published(self.model) as trained:
                state.trained_weights = trained
                upload = self.publisher.publish(step, self.model, self.tokenizer, state)
        upload.add_done_callback(functools.partial(self._published, step))
        self.ctx.state.update(checkpoint_step=step)
        self.tracking.flush()

    def _published(self, step: int, upload: Future[bool]) -> None:
        """On the publisher thread, once checkpoint ``step`` is announced and complete in the
        store (its training state too)."""
        if upload.exception() is not None:  # a failed upload surfaces in publisher.flush()
            return
        if not upload.result():  # announced by a trainer that died before its state was in
            return
        self.telemetry.checkpoint_published(step)
        self.tables.checkpoint_complete(step)
        try:
            self.retention.sweep_checkpoints()  # store.keep_checkpoints
            self._update_store_bytes()
        except (*REDIS_UNAVAILABLE, StorageError) as error:  # retried at the next checkpoint
            self.ctx.log.warning("checkpoint retention / store size failed: %s", error)

    def _update_store_bytes(self) -> None:
        """The run's store size (one listing, at each checkpoint: Status and the summary
        read this cached value, never the store)."""
        self.store_bytes = self.ctx.store.usage()
        self.ctx.state.update(store_bytes=self.store_bytes)

    def summary(self, finished: bool) -> dict:
        rec = self.record
        return {
            "finished": finished,
            "steps": self.step,
            # training.steps, or training.epochs resolved on the dataset (config.resolve_budget)
            "budget": budget_summary(self.cfg.training),
            # training.early_stopping ended the run before its budget (None: it did not)
            "stopped_early": self.stopped_early,
            "losses": rec.losses,
            "dual_losses": rec.dual_losses,
            "hard_negatives": rec.hard_negatives,
            "grad_norms": rec.grad_norms,
            "async_gaps": rec.async_gaps,
            "negatives_steps": rec.negatives_steps,
            "swaps": rec.swaps,
            # Every refresh table the feed swapped in (a step may never train on one that a
            # newer table overtook): refresh step -> Unix times it was read and swapped in.
            "tables_swapped_in": {str(k): v for k, v in sorted(self.feed.swap_times.items())},
            "checkpoints": rec.checkpoints,
            "resumed_from": rec.resumed_from,
            "step_seconds": rec.step_seconds,
            "negatives_ms": rec.negatives_ms,
            "prepare_ms": rec.prepare_ms,
            "prepare_wait_ms": rec.prepare_wait_ms,
            "wait_before_first_s": rec.wait_before_first_s,
            "torch_threads": rec.torch_threads,
            # Bytes of the run's objects when the trainer finished (the final refresh is
            # still to come; the launcher's summary.json has the size at the very end).
            "store_bytes": self.store_bytes,
            # Everything the loop spent obtaining negatives once the first table was in use:
            # the feed never blocks, so this is only sampling time (ANCE Table 5: 72 ms/batch).
            "negatives_s_after_first": self._negatives_seconds_after_first(),
        }

    def _negatives_seconds_after_first(self) -> float:
        rec = self.record
        first = next((i for i, s in enumerate(rec.negatives_steps) if s is not None), None)
        return 0.0 if first is None else sum(rec.negatives_ms[first:]) / 1000


@dataclass
class _Next:
    """What rank 0 sends the other ranks before each step: go on, and the batch of the step
    after this one (None: this step is the last)."""

    batch: PlannedBatch | None
    final: bool = False  # early stopping: this step is the last and is checkpointed


def serve(ctx: ServiceContext) -> int:
    if ctx.config.training.processes > 1 and "TORCHELASTIC_RUN_ID" in os.environ:
        # A rank blocked in a collective never sees SIGTERM's stop flag: if its
        # torch.distributed.run agent dies (killed with the launcher or its pod's main
        # process), the kernel kills the rank instead of leaving it waiting for RANK_TIMEOUT.
        die_with_parent(signal.SIGKILL)
        if os.getppid() == 1:  # the agent died before the line above
            return 1
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if ctx.config.training.processes > 1 and restart:
        # torch.distributed.run started every rank again after one failed (--max-restarts,
        # training.max_restarts): the group resumes from the newest complete checkpoint.
        ctx.log.warning("rank group restart %d of at most %s", restart,
                        os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?"))
    try:
        if ctx.config.training.processes > 1 and launched_rank() > 0:
            # Not a service of its own: no gRPC server, no registry entry (rank 0 is the
            # trainer).
            ctx.install_signal_handlers()
            Trainer(ctx).run()
            return 0
        return ctx.serve(Trainer(ctx).run, finishes=True)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
