"""Run tracking: the scalars of a run in TensorBoard (and W&B / MLflow when asked for).

``tracking.report_to`` (config) lists the trackers, like the Hugging Face Trainer's
``report_to``. Each role writes its own scalars into its own TensorBoard directory
``<logdir>/<role>`` so that roles never share an event file: the trainer per step (global
step = training step), the indexer per refresh (global step = the checkpoint step).

Where the event files go:

* ``tracking.logdir`` set: directly under it (a mounted volume);
* the embedded mode: directly under ``runs/<run_id>/tensorboard`` (the launcher passes it in
  :data:`TENSORBOARD_DIR_VAR`);
* otherwise (a cluster run): into the work directory, uploaded to the object store under
  ``tensorboard/<role>/`` (:func:`ance_train.protocol.keys.tensorboard_file`) by a background
  thread every ``tracking.upload_every_s`` and once more at the end, so that
  ``tensorboard --logdir s3://<bucket>/<run_id>/tensorboard`` reads it.

Writing a scalar only queues it (TensorBoard's ``EventFileWriter`` writes on its own thread)
and uploads never run on the caller's thread, so tracking does not slow a training step. The
writer is TensorBoard's own, the one ``torch.utils.tensorboard.SummaryWriter`` wraps: the
same files, without importing torch (about 2 s of every indexer start, which needs no torch).
"""

from __future__ import annotations

import abc
import logging
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ance_train.protocol import keys

if TYPE_CHECKING:
    from ance_train.config import RunConfig
    from ance_train.infra.store import ObjectStore

log = logging.getLogger(__name__)

# Set by the embedded launcher: write TensorBoard files directly under this directory.
TENSORBOARD_DIR_VAR = "ANCE_TENSORBOARD_DIR"


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Nested mappings of numbers as ``a/b/c`` → value; booleans, None and text are left out."""
    flat: dict[str, float] = {}
    for name, value in values.items():
        tag = f"{prefix}{name}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{tag}/"))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            flat[tag] = float(value)
    return flat


class Tracker(abc.ABC):
    """One destination of a role's scalars."""

    @abc.abstractmethod
    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Record ``values`` (tag → number) at global step ``step``."""

    def flush(self) -> None:  # noqa: B027 - optional
        """Make what was recorded so far visible (cheap; called at checkpoints / refreshes)."""

    def close(self) -> None:  # noqa: B027 - optional
        """Write out what is buffered; the tracker is not used afterwards."""


class TensorBoardTracker(Tracker):
    """TensorBoard event files in ``directory`` (one event per ``scalars`` call, each value
    a ``simple_value`` as ``SummaryWriter.add_scalar`` writes it); with a ``store``, uploaded
    there under ``tensorboard/<role>/`` in the background."""

    def __init__(self, directory: Path, role: str, store: ObjectStore | None = None,
                 upload_every_s: float = 60.0) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary  # imported once, not on every step
        self.directory = directory
        self.role = role
        self.store = store
        directory.mkdir(parents=True, exist_ok=True)
        self.writer = EventFileWriter(str(directory), flush_secs=30)
        self._lock = threading.Lock()  # one upload at a time (the thread's and close's)
        self._closed = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        if store is not None:
            self._thread = threading.Thread(target=self._upload_loop, args=(upload_every_s,),
                                            name=f"tensorboard-upload-{role}", daemon=True)
            self._thread.start()

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        kept = [self._summary.Value(tag=tag, simple_value=float(value))
                for tag, value in values.items() if value is not None and math.isfinite(value)]
        if kept:
            self.writer.add_event(self._event(wall_time=time.time(), step=int(step),
                                              summary=self._summary(value=kept)))

    def flush(self) -> None:
        """Write the queued events to the files; a store-backed tracker also uploads them
        soon, on its thread."""
        self.writer.flush()
        self._wake.set()

    def _upload_loop(self, every_s: float) -> None:
        while True:
            self._wake.wait(every_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.upload()
            except Exception as error:  # the next round or close() tries again
                log.warning("uploading TensorBoard files failed: %s", error)

    def upload(self) -> None:
        """Flush and copy every event file to the store (each a snapshot: the writer keeps
        appending while the copy is uploaded)."""
        if self.store is None:
            return
        with self._lock:
            if not self._closed:
                self.writer.flush()
            with tempfile.TemporaryDirectory(prefix="tb-upload-") as tmp:
                for path in sorted(self.directory.iterdir()):
                    if not path.is_file():
                        continue
                    snapshot = Path(tmp) / path.name
                    shutil.copyfile(path, snapshot)
                    self.store.put_file(keys.tensorboard_file(self.role, path.name), snapshot)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.writer.close()  # flushes; a closed EventFileWriter refuses flush()
        self._closed = True
        self.upload()


def _safe_tag(tag: str) -> str:
    """MLflow metric names allow letters, digits, ``_-. /``: ``ndcg@10`` → ``ndcg_at_10``."""
    return "".join(c if c.isalnum() or c in "_-. /" else "_" for c in tag.replace("@", "_at_"))


class WandbTracker(Tracker):
    """Weights & Biases: one W&B run per role, grouped by the run id; project, entity and
    credentials come from the environment (``WANDB_PROJECT``, ``WANDB_API_KEY``, ...)."""

    def __init__(self, config: RunConfig, role: str) -> None:
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "ance-train"),
                              group=config.run_id, name=f"{config.run_id}-{role}",
                              job_type=role, config=config.model_dump(mode="json"),
                              reinit=True)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    """MLflow: one MLflow run per role in the experiment named after the run id
    (``MLFLOW_EXPERIMENT_NAME`` overrides it); the tracking URI comes from the environment
    (``MLFLOW_TRACKING_URI``)."""

    def __init__(self, config: RunConfig, role: str) -> None:
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", config.run_id))
        self.run = mlflow.start_run(run_name=f"{config.run_id}-{role}")
        mlflow.log_params(flatten_params(config.model_dump(mode="json")))

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self.mlflow.log_metrics({_safe_tag(tag): v for tag, v in values.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def flatten_params(values: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for name, value in values.items():
        if isinstance(value, Mapping):
            flat.update(flatten_params(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = str(value)
    return flat


class Tracking(Tracker):
    """Every tracker the configuration asks for, behind one interface. A tracker that fails
    while logging is reported once and then left alone: tracking never stops a run."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers
        self._failed: set[int] = set()

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        if not values:
            return
        for number, tracker in enumerate(self.trackers):
            if number in self._failed:
                continue
            try:
                tracker.scalars(step, values)
            except Exception as error:
                self._failed.add(number)
                log.warning("%s failed, no more scalars go to it: %s",
                            type(tracker).__name__, error)

    def flush(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.flush()
            except Exception as error:
                log.warning("flushing %s failed: %s", type(tracker).__name__, error)

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as error:
                log.warning("closing %s failed: %s", type(tracker).__name__, error)

    @property
    def tensorboard(self) -> TensorBoardTracker | None:
        return next((t for t in self.trackers if isinstance(t, TensorBoardTracker)), None)


def tensorboard_dir(config: RunConfig, work_dir: Path) -> tuple[Path, bool]:
    """Where the TensorBoard files are written, and whether they are uploaded to the store."""
    if config.tracking.logdir:
        return Path(config.tracking.logdir), False
    direct = os.environ.get(TENSORBOARD_DIR_VAR, "").strip()
    if direct:
        return Path(direct), False
    return work_dir / "tensorboard", True


def open_tracking(config: RunConfig, role: str, store: ObjectStore | None,
                  work_dir: Path) -> Tracking:
    """The trackers of ``role`` (``trainer`` or ``indexer``) as ``tracking.report_to`` says."""
    trackers: list[Tracker] = []
    settings = config.tracking
    for name in settings.report_to:
        if name == "tensorboard":
            root, upload = tensorboard_dir(config, work_dir)
            trackers.append(TensorBoardTracker(root / role, role,
                                               store if upload else None,
                                               settings.upload_every_s))
        elif name == "wandb":
            trackers.append(WandbTracker(config, role))
        elif name == "mlflow":
            trackers.append(MlflowTracker(config, role))
    return Tracking(trackers)
