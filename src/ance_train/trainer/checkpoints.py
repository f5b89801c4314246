"""Checkpoint publishing: save locally in the loop, upload + announce in the background.

Order per checkpoint (the contract other services rely on): every file of the checkpoint is
in the store (its MANIFEST written last) → the latest-checkpoint marker moves → the shard
work items are queued → ``checkpoint.published`` is sent. Uploads run on one background
thread, so the trainer never waits for the object store.

Every checkpoint also holds the training state (:mod:`.training_state`), so a restarted
trainer resumes from the newest checkpoint whose MANIFEST is in the store.
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
from ance_train.infra.store import MANIFEST_NAME, LocalStore, ObjectStore
from ance_train.modeling.model import BiEncoder
from ance_train.protocol import keys
from ance_train.protocol.events import CheckpointPublished
from ance_train.protocol.work import RefreshPlan, ShardKind
from ance_train.trainer.training_state import TrainingState

log = logging.getLogger(__name__)


def latest_complete_checkpoint(store: ObjectStore) -> int | None:
    """The newest checkpoint step whose MANIFEST (written last by ``put_dir``) is stored."""
    steps = [keys.checkpoint_step(key) for key in store.list(keys.CHECKPOINTS)
             if key.endswith(f"/{MANIFEST_NAME}") and key.count("/") == 2]
    return max((step for step in steps if step is not None), default=None)


def checkpoint_bytes(model: BiEncoder, optimizer_state: dict) -> int:
    """Bytes a checkpoint will take: the weights plus every tensor of the optimizer state
    (AdamW: two per parameter), as ``save`` writes them."""
    import torch

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    stack, state = [optimizer_state], 0
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
        # step -> Unix times of its local save (started, done): the refresh timeline's first
        # row, sent with checkpoint.published.
        self._saved: dict[int, tuple[float, float]] = {}

    def save(self, step: int, model: BiEncoder, tokenizer, state: TrainingState,
             disk_usage: DiskUsageFn = shutil.disk_usage) -> Path:
        """Write checkpoint ``step`` locally, after checking that the disk can hold it (and its
        copy in a local store): when it cannot, the uploads in flight are finished first, so
        every checkpoint already written is stored and the run resumes from the newest, and
        :class:`InsufficientDisk` stops the trainer before a half-written checkpoint."""
        directory = self.local_dir / str(step)
        needed = checkpoint_bytes(model, state.optimizer)
        if isinstance(self.store, LocalStore):
            needed *= 2  # the upload writes a second copy on the same machine
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
        state.save(directory)
        self._saved[step] = (started, time.time())
        return directory

    def fetch(self, step: int) -> Path:
        """Download checkpoint ``step`` (verified against its manifest) to resume from it."""
        directory = self.local_dir / str(step)
        if directory.exists():
            shutil.rmtree(directory)
        self.store.get_dir(keys.checkpoint(step), directory)
        return directory

    def ensure_announced(self, step: int) -> None:
        """Finish the publication of a stored checkpoint whose event never went out (the
        trainer died between the MANIFEST and the event); a published one is left alone."""
        if any(r.event.step == step for r in self.bus.history(CheckpointPublished)):
            return
        log.info("checkpoint %d is stored but was never announced: announcing it", step)
        self._announce(step)

    def publish_async(self, step: int, directory: Path) -> Future:
        future = self._executor.submit(self._publish, step, directory)
        self._pending.append(future)
        return future

    def _publish(self, step: int, directory: Path) -> None:
        upload_started = time.time()
        self.store.put_dir(keys.checkpoint(step), directory)
        save_started, saved = self._saved.pop(step, (None, None))
        self._announce(step, save_started_at=save_started, saved_at=saved,
                       upload_started_at=upload_started, uploaded_at=time.time())
        self._prune_local(keep=step)

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
