"""Checkpoint publishing: save locally in the loop, upload + announce in the background.

Order per checkpoint (the contract other services rely on; :mod:`ance_train.protocol.checkpoints`
says what each stage means to them):

1. the loop writes the model's files locally and hands them to the publisher thread, then
   writes the training state (optimizer moments, RNG states, ...) while they upload;
2. every model file is in the store, then ``WEIGHTS.json`` listing them;
3. the latest-checkpoint marker moves → the shard work items are queued →
   ``checkpoint.published`` is sent: inferencers may load the checkpoint from here on;
4. the training state is in the store, then ``MANIFEST.json`` listing every file, written
   last: the checkpoint is complete, and a restarted trainer resumes from the newest
   complete one.

So a refresh waits for the weights only; the training state (twice the weights with AdamW)
uploads while the inferencers encode. Uploads run on one background thread, in step order, so
the trainer never waits for the object store, and a checkpoint with ``WEIGHTS.json`` alone
is either the one uploading its state now or one whose trainer died before its state was
stored: it is never resumed from. A trainer restarted behind such a checkpoint (resumed from
an older complete one) that comes back to its step leaves it as it is: it was announced,
its refresh ran or runs on those weights, and it stays a checkpoint without a resume point
(each checkpoint is announced once). With a local store the files are hard-linked into it,
not copied (``share``): the loop writes every checkpoint into a fresh directory and never
writes into a file once saved.
"""

from __future__ import annotations

import logging
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ance_train.config import RunConfig
from ance_train.data.dataset import DatasetIndex
from ance_train.infra.bus import EventBus, WorkQueue
from ance_train.infra.disk import (
    DiskUsageFn,
    InsufficientDisk,
    check_free,
    tree_bytes,
)
from ance_train.infra.store import LocalStore, ObjectStore
from ance_train.modeling.model import BiEncoder
from ance_train.protocol import keys
from ance_train.protocol.checkpoints import complete_checkpoints
from ance_train.protocol.events import CheckpointPublished
from ance_train.protocol.work import RefreshPlan, ShardKind
from ance_train.trainer.training_state import TrainingState

log = logging.getLogger(__name__)

# Names a checkpoint directory may not hold: its two manifests are written by the publisher.
RESERVED = (keys.CHECKPOINT_MANIFEST, keys.CHECKPOINT_WEIGHTS_MANIFEST)


def latest_complete_checkpoint(store: ObjectStore) -> int | None:
    """The newest checkpoint step whose MANIFEST.json (written last) is stored: one with
    ``WEIGHTS.json`` alone has no training state to resume from."""
    return max(complete_checkpoints(store.list(keys.CHECKPOINTS)), default=None)


def checkpoint_bytes(model: BiEncoder, training: TrainingState) -> int:
    """Bytes a checkpoint will take: the weights plus every tensor of the training state, as
    ``save`` writes them: the optimizer's (AdamW: two per parameter) and, where the model
    files hold a WiSE-FT blend, the trained weights (``trained_weights``)."""
    import torch

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    stack: list[object] = [training.optimizer, training.trained_weights]
    state = 0
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            state += item.numel() * item.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return int(weights + state)


class CheckpointPublisher:
    def __init__(self, store: ObjectStore, bus: EventBus, queue: WorkQueue,
                 config: RunConfig, dataset: DatasetIndex, work_dir: Path,
                 keep_local: int = 2) -> None:
        self.store = store
        self.bus = bus
        self.queue = queue
        self.config = config
        self.dataset = dataset
        self.local_dir = work_dir / "checkpoints"
        self.keep_local = keep_local
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="publisher")
        self._pending: list[Future] = []
        # Steps announced before this process published any (read once, at its first):
        # those of a dead trainer, which a resumed one may come back to.
        self._announced_earlier: set[int] | None = None

    def publish(self, step: int, model: BiEncoder, tokenizer, state: TrainingState,
                disk_usage: DiskUsageFn = shutil.disk_usage) -> Future[bool]:
        """Write checkpoint ``step`` locally and publish it in the background (the order in
        the module docstring): the model's files are written, their upload and the
        announcement start on the publisher thread, then the training state is written
        here. Returns when both are written locally; the future says once the publication
        is over whether the checkpoint is complete in the store (False: announced by a
        trainer that died before storing its state, left so).

        The disk is checked first for the checkpoint (and its copy in a local store): when
        it cannot hold it, the uploads in flight are finished first, so every checkpoint
        already written is stored and the run resumes from the newest, and
        :class:`InsufficientDisk` stops the trainer before a half-written checkpoint."""
        directory = self.local_dir / str(step)
        needed = checkpoint_bytes(model, state)
        if isinstance(self.store, LocalStore):
            needed *= 2  # a copy, where the store cannot hard-link the files
        try:
            check_free(self.local_dir, needed, f"checkpoint {step}",
                       "Free disk (the trainer stopped; it resumes from the newest stored "
                       "checkpoint) or set store.keep_checkpoints to keep fewer.",
                       reclaimable=tree_bytes(directory), disk_usage=disk_usage)
        except InsufficientDisk:
            self.flush()
            raise
        started = time.time()
        if directory.exists():
            shutil.rmtree(directory)
        model.save(directory, tokenizer)
        weights = self.store.dir_files(directory, RESERVED)
        state_written: Future[None] = Future()
        future = self._executor.submit(self._publish, step, directory, weights, state_written,
                                       (started, time.time()))
        self._pending.append(future)
        try:
            state.save(directory)
        except BaseException as error:  # no MANIFEST.json: the checkpoint stays incomplete
            state_written.set_exception(error)
            raise
        state_written.set_result(None)
        return future

    def fetch(self, step: int) -> Path:
        """Download checkpoint ``step`` (verified against its MANIFEST.json) to resume from
        it."""
        directory = self.local_dir / str(step)
        if directory.exists():
            shutil.rmtree(directory)
        self.store.get_dir(keys.checkpoint(step), directory,
                           manifest_name=keys.CHECKPOINT_MANIFEST)
        return directory

    def ensure_announced(self, step: int) -> None:
        """Finish the publication of a stored checkpoint whose event never went out (its
        announcement failed, and its state was stored all the same); a published one is
        left alone."""
        if any(r.event.step == step for r in self.bus.history(CheckpointPublished)):
            return
        log.info("checkpoint %d is stored but was never announced: announcing it", step)
        self._announce(step)

    def _publish(self, step: int, directory: Path, weights: list[str],
                 state_written: Future[None], saved: tuple[float, float]) -> bool:
        """On the publisher thread: the weights, the announcement, the state (module
        docstring); True once the checkpoint is complete."""
        if self._announced_earlier is None:  # by a trainer process before this one
            self._announced_earlier = {r.event.step for r in
                                       self.bus.history(CheckpointPublished)}
        if (step in self._announced_earlier
                and self.store.exists(keys.checkpoint_weights_manifest(step))):
            log.warning("checkpoint %d was announced by a trainer that died before storing "
                        "its training state: its stored weights (which its refresh used) stay "
                        "as they are, and it will not be resumed from", step)
            state_written.result()
            self._prune_local(keep=step)
            return False
        prefix = keys.checkpoint(step)
        upload_started = time.time()
        # Either manifest would describe the files about to be replaced: both go first.
        self.store.delete(keys.checkpoint_manifest(step))
        self.store.delete(keys.checkpoint_weights_manifest(step))
        files = self.store.put_files(prefix, directory, weights, share=True)
        self.store.put_manifest(prefix, files, keys.CHECKPOINT_WEIGHTS_MANIFEST)
        uploaded = time.time()
        announce_failed: Exception | None = None
        try:
            self._announce(step, save_started_at=saved[0], saved_at=saved[1],
                           upload_started_at=upload_started, uploaded_at=uploaded)
        except Exception as error:  # stored complete all the same: a restarted trainer
            announce_failed = error  # resumes from it and announces it (ensure_announced)
        state_written.result()  # the loop's error, if writing the state failed
        state = [rel for rel in self.store.dir_files(directory, RESERVED) if rel not in files]
        files.update(self.store.put_files(prefix, directory, state, share=True))
        self.store.put_manifest(prefix, files, keys.CHECKPOINT_MANIFEST)
        if announce_failed is not None:
            raise announce_failed
        self._prune_local(keep=step)
        return True

    def _announce(self, step: int, **times: float | None) -> None:
        """Queue the checkpoint's shards and publish it; ``times``: its timeline so far
        (:class:`CheckpointPublished`'s ``*_at`` fields; none when announced again)."""
        plan = RefreshPlan.for_run(step, self.config, self.dataset)
        if times:  # from here on the checkpoint is visible: replicas may claim its work
            times["published_at"] = time.time()
        self.bus.set_latest_checkpoint(step)
        self.queue.enqueue(plan.work(ShardKind.CORPUS))
        self.queue.enqueue(plan.work(ShardKind.QUERIES))
        self.bus.publish(CheckpointPublished(step=step, key=keys.checkpoint(step), plan=plan,
                                             **times))
        log.info("checkpoint %d published (%d corpus + %d query shards)", step,
                 len(plan.corpus_ranges), len(plan.query_ranges))

    def _prune_local(self, keep: int) -> None:
        steps = sorted(int(p.name) for p in self.local_dir.iterdir() if p.name.isdigit())
        for old in steps[: -self.keep_local]:
            if old != keep:
                shutil.rmtree(self.local_dir / str(old), ignore_errors=True)

    def flush(self) -> None:
        """Wait for every upload (end of run); re-raises an upload failure."""
        for future in self._pending:
            future.result()
        self._pending.clear()

    def close(self) -> None:
        self._executor.shutdown(wait=True)
