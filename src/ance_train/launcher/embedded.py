"""``ance-train run``: the embedded mode — all three services as OS processes on this machine.

Validates the configuration and the dataset before anything starts, launches a private
Redis server, the object store (a local directory, or S3 when ``ANCE_S3_ENDPOINT`` is set),
the trainer, the indexer (``index.partitions`` processes) and ``inference.replicas``
inferencers, then shows progress and a metrics table at every refresh until the final
checkpoint is evaluated. A service process (or Redis) that exits is started again as the
kubelet would (``services.restart``, :mod:`ance_train.launcher.supervisor`); Ctrl-C, or a
service crashing beyond its restart budget, stops every child; children also die with the
launcher (PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ance_train.config import RunConfig, dump_config, resolve_budget
from ance_train.data.validation import selection_notices, validate_dataset
from ance_train.index.capacity import encoder_size, run_store_bytes
from ance_train.infra.bus import REDIS_UNAVAILABLE, EventBus, connect
from ance_train.infra.credentials import redis_password
from ance_train.infra.disk import DiskUsageFn, check_free, size, tree_bytes
from ance_train.infra.env import PARTITION_VAR
from ance_train.infra.process import die_with_parent
from ance_train.infra.retention import RunRetention
from ance_train.infra.rpc import fetch_status
from ance_train.infra.store import LocalStore, ObjectStore, StorageError, store_from_env
from ance_train.launcher.placement import Placement, place, visible_gpus
from ance_train.launcher.ports import free_port
from ance_train.launcher.redis_server import RedisServer
from ance_train.launcher.supervisor import CrashLoop, Supervisor
from ance_train.launcher.warm_start import (
    SERVER_VAR,
    ProcessHandle,
    WarmStarter,
    WarmStartError,
)
from ance_train.modeling.files import check_encoder
from ance_train.modeling.source import ResolvedModel, publish_model, resolve_model
from ance_train.observability.tracking import TENSORBOARD_DIR_VAR
from ance_train.protocol import keys
from ance_train.protocol.events import EvalCompleted, RunFinished
from ance_train.runtime import publish_dataset

# Logs and CI are not terminals: keep the metrics table readable there too.
console = Console(width=None if sys.stdout.isatty() else 150, soft_wrap=True)
SHOWN_METRICS = ("ndcg@10", "mrr@10", "recall@100")


class RunAborted(RuntimeError):
    pass


@dataclass
class Child:
    """A service process; :meth:`restart` starts it again with the same name, port, work
    directory and log (appended to)."""

    name: str
    role: str
    port: int
    process: ProcessHandle
    log_path: Path
    launch: Callable[[], ProcessHandle]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 3000) -> str:
        return _tail(self.log_path, chars)

    def returncode(self) -> int | None:
        return self.process.poll()

    def done(self, code: int) -> bool:
        """Only the trainer finishes: exit 0 once it trained every step."""
        return self.role == "trainer" and code == 0

    def restart(self) -> None:
        # The process was a session leader (start_new_session): whatever it started (a
        # torchrun agent's ranks) is in its process group and goes with it.
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process = self.launch()


@dataclass
class RedisChild:
    """The run's redis-server under the supervisor: restarted on the same port and AOF
    directory, so the services' clients reconnect to it and find their streams."""

    server: RedisServer
    name: str = "redis"

    def returncode(self) -> int | None:
        return None if self.server.process is None else self.server.process.poll()

    def done(self, code: int) -> bool:
        return False

    def restart(self) -> None:
        self.server.start()

    def log_tail(self, chars: int = 3000) -> str:
        return _tail(self.server.directory / "redis.log", chars)


def _tail(path: Path, chars: int) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


@dataclass
class RunResult:
    evaluations: list[dict] = field(default_factory=list)
    trainer_summary: dict = field(default_factory=dict)
    seconds: float = 0.0
    store_bytes: int | None = None  # the run's objects once every service has stopped
    restarts: list[dict] = field(default_factory=list)  # supervisor.Restart, as dicts


# What may differ between an interrupted run's stored configuration and the one it resumes
# with (``ance-train run --resume``): where and how fast the processes run, never what they
# compute. Everything else would make the resumed steps, tables or metrics another run's.
RESUME_SAFE_FIELDS = ("output_dir", "services", "tracking", "index.search",
                      "inference.replicas", "inference.torch_threads",
                      "inference.claim_timeout_s", "inference.max_attempts",
                      "inference.reuse_between_refreshes", "inference.token_cache_mb",
                      "inference.warm_token_cache",
                      "training.torch_threads", "training.torch_threads_between_refreshes",
                      "training.max_restarts")


def _flat(values: object, prefix: str = "") -> dict[str, object]:
    if isinstance(values, dict) and values:
        return {key: value for name, item in values.items()
                for key, value in _flat(item, f"{prefix}{name}.").items()}
    return {prefix.rstrip("."): values}


def resume_conflicts(stored: RunConfig, config: RunConfig) -> list[str]:
    """The fields (dotted paths) in which ``config`` differs from an interrupted run's
    ``stored`` configuration, other than :data:`RESUME_SAFE_FIELDS`, each as
    ``"path: stored → new"``."""
    before, after = _flat(stored.model_dump(mode="json")), _flat(config.model_dump(mode="json"))
    changed = sorted(key for key in before.keys() | after.keys()
                     if before.get(key, "(absent)") != after.get(key, "(absent)"))
    return [f"{key}: {before.get(key, '(absent)')!r} → {after.get(key, '(absent)')!r}"
            for key in changed
            if not any(key == safe or key.startswith(safe + ".") for safe in RESUME_SAFE_FIELDS)]


class EmbeddedRun:
    def __init__(self, config: RunConfig, config_path: Path, overwrite: bool = False,
                 max_minutes: float | None = None, resume: bool = False) -> None:
        """``resume``: continue the interrupted run in the run directory from its newest
        complete checkpoint (:meth:`_check_resumable`), keeping everything it produced."""
        if resume and overwrite:
            raise ValueError("resume and overwrite exclude each other")
        self.config = config
        self.config_path = config_path
        self.run_dir = Path(config.output_dir) / config.run_id
        self.overwrite = overwrite
        self.resume = resume
        self.max_minutes = max_minutes
        self.children: list[Child] = []
        self.redis: RedisServer | None = None
        self.redis_url = ""
        self.finished = False  # the final checkpoint was evaluated
        self.stopped = False
        self.supervisor = Supervisor(config.services.restart)
        self.placement = Placement([])  # the GPUs of each process (start_services)
        self.warm: WarmStarter | None = None  # the zygote, when services.warm_start
        self.encoder_type: str | None = None  # the base model's model_type (_resolve_model)

    # -- set-up ---------------------------------------------------------------------------
    def prepare(self) -> None:
        """Validate everything first: a bad config, model or dataset never touches an existing
        run."""
        if self.resume:
            self._check_resumable()
        elif self.run_dir.exists() and any(self.run_dir.iterdir()) and not self.overwrite:
            raise RunAborted(f"run directory {self.run_dir} already exists; pass --overwrite "
                             "to replace it, --resume to continue it, or change run_id")
        shared_store, stale = self._stale_store_objects()
        # A Hub id / s3:// model is resolved once, here, before any work; the services train
        # from the copy published into the run's store below (modeling/source.py).
        self.base_model = self._resolve_model()
        staging = self.run_dir.parent / f".{self.config.run_id}.validating"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            with console.status("validating dataset"):
                self.dataset = validate_dataset(self.config.data, staging,
                                                seed=self.config.data.split_seed)
                # training.epochs → steps (the same function every service calls)
                self.config = resolve_budget(self.config, self.dataset.trainable_queries)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            self.base_model.cleanup()
            raise
        try:
            if self.resume:
                self._check_same_dataset(shared_store, staging)
            self._check_disk(staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            self.base_model.cleanup()
            raise
        if self.resume:  # the run's own cache, identical (checked), stays
            shutil.rmtree(staging, ignore_errors=True)
        else:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            for key in stale:
                shared_store.delete(key)
            self.run_dir.mkdir(parents=True)
            (self.run_dir / "logs").mkdir()
            staging.rename(self.run_dir / "cache")
        for warning in self.dataset.warnings:
            console.print(f"[yellow]warning:[/] {warning}")
        for level, text in selection_notices(self.dataset, self.config.training):
            console.print(f"[yellow]{level}:[/] {text}")
        console.print(f"dataset: {self.dataset.num_docs} docs, {len(self.dataset.train)} train / "
                      f"{len(self.dataset.dev)} dev / {len(self.dataset.test)} test queries")
        self.resolved_config = self.run_dir / "config.yaml"
        self.resolved_config.write_text(dump_config(self.config))
        self.store_dir = self.run_dir / "store"
        self.env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        if "ANCE_S3_ENDPOINT" not in self.env:
            self.env["ANCE_STORE_DIR"] = str(self.store_dir)
        # TensorBoard files go straight into the run directory (tracking.logdir wins).
        self.env[TENSORBOARD_DIR_VAR] = str((self.run_dir / "tensorboard").resolve())
        self.store = store_from_env(self.config.run_id, str(self.store_dir))
        try:
            publish_model(self.store, self.base_model)
        finally:
            self.base_model.cleanup()
        if not self.resume:  # a resumed run's services read the index it published
            publish_dataset(self.store, self.run_dir / "cache")
        # The private Redis takes ANCE_REDIS_PASSWORD when the shell has one, so that the
        # services, this monitor and `ance-train status` (which all read it) can authenticate;
        # the password never goes into a URL or a file.
        self.redis = RedisServer(self.run_dir / "redis", password=redis_password()).start()
        self.supervisor.add(RedisChild(self.redis))
        self.redis_url = f"redis://127.0.0.1:{self.redis.port}/0"
        self.env["ANCE_REDIS_URL"] = self.redis_url
        (self.run_dir / "endpoints.json").write_text(json.dumps({"redis_url": self.redis_url}))

    def _resolve_model(self) -> ResolvedModel:
        """The base model as a local directory (downloaded when it is a Hub id or s3://),
        checked to be a text encoder with its tokenizer."""
        scratch = self.run_dir.parent / f".{self.config.run_id}.model"
        resolved = resolve_model(self.config.model, scratch)
        try:
            self.encoder_type = str(check_encoder(resolved.directory)["model_type"])
        except BaseException:
            resolved.cleanup()
            raise
        return resolved

    def _check_disk(self, staging: Path, disk_usage: DiskUsageFn = shutil.disk_usage) -> None:
        """Refuse to start when the run directory's disk cannot hold what the run will store
        (``plan``'s sizes times retention; the trainer's two local checkpoint copies besides):
        a clear error now instead of ENOSPC mid-run. A store in S3 is not checked."""
        if "ANCE_S3_ENDPOINT" in os.environ:
            return
        cfg, dataset = self.config, self.dataset
        params, dim = encoder_size(self.base_model.directory, cfg.model.projection_dim)
        eval_queries = sum(len(getattr(dataset, split)) for split in cfg.index.eval_splits)
        need = run_store_bytes(cfg, docs=dataset.num_docs, train_queries=len(dataset.train),
                               eval_queries=eval_queries, dim=dim, model_params=params,
                               dataset_bytes=tree_bytes(staging))
        local = 2 * need.per_checkpoint  # CheckpointPublisher keeps two locally
        retention = cfg.store
        check_free(
            self.run_dir / "store", need.total + local,
            f"run {cfg.run_id}'s store ({need.describe()}; {need.kept_checkpoints} of "
            f"{need.checkpoints} checkpoints and {need.kept_refreshes} refreshes kept) and the "
            f"trainer's local checkpoints ({size(local)})",
            f"Free disk, or bound the store with store.keep_checkpoints (now "
            f"{retention.keep_checkpoints}) and store.keep_refreshes (now "
            f"{retention.keep_refreshes}), fewer checkpoints (training.refresh_every "
            f"{cfg.training.refresh_every} of {cfg.training.total_steps} steps), "
            + ("inference.embedding_dtype float16, "
               if cfg.inference.embedding_dtype == "float32" else "")
            + "or an output_dir on a larger disk.",
            # --overwrite frees the old run; a resumed run's objects count towards its need.
            reclaimable=tree_bytes(self.run_dir) if self.overwrite or self.resume else 0,
            disk_usage=disk_usage)

    def _check_resumable(self) -> None:
        """``--resume``: the run directory holds an embedded run that did not finish, and the
        configuration differs from the one it ran with in safe fields only
        (:data:`RESUME_SAFE_FIELDS`); else :class:`RunAborted` saying why, touching nothing.
        The services then resume as after a crash: the trainer from the newest complete
        checkpoint (weights, optimizer, RNG, batch position, negatives tables and records:
        trainer/training_state.py), the indexer and inferencers from the streams kept in the
        run's Redis data (``redis/``) and the objects in its store."""
        from ance_train.config import ConfigError, load_config

        stored_path = self.run_dir / "config.yaml"
        if not stored_path.is_file():
            raise RunAborted(f"--resume: {self.run_dir} holds no embedded run to continue "
                             f"({stored_path.name} is missing)")
        try:
            stored = load_config(stored_path)
        except ConfigError as error:
            raise RunAborted(f"--resume: the run's stored configuration is unreadable: "
                             f"{error}") from None
        conflicts = resume_conflicts(stored, self.config)
        if conflicts:
            raise RunAborted(
                f"--resume {self.run_dir}: the configuration differs from the one the run "
                f"started with ({stored_path}) in " + "; ".join(conflicts)
                + ". Only these may change on resume: " + ", ".join(RESUME_SAFE_FIELDS))
        summary = self.run_dir / "summary.json"
        if summary.is_file() and json.loads(summary.read_text()).get(
                "trainer", {}).get("finished"):
            raise RunAborted(f"--resume: run {self.config.run_id} in {self.run_dir} already "
                             "finished; nothing to continue")

    def _check_same_dataset(self, store: ObjectStore, staging: Path) -> None:
        """``--resume``: the dataset, validated again, gives the index the run published
        (else its documents and queries are not the ones its checkpoints and tables index)."""
        for key, name in ((keys.DATASET_INDEX, keys.DATASET_INDEX_FILE),
                          (keys.DOC_OFFSETS, keys.DOC_OFFSETS_FILE)):
            if not store.exists(key) or store.get_bytes(key) != (staging / name).read_bytes():
                raise RunAborted(f"--resume: the dataset at {self.config.data.path} is not the "
                                 f"one run {self.config.run_id} started on (its {key} in the "
                                 "store differs or is missing)")

    def _stale_store_objects(self) -> tuple[ObjectStore, list[str]]:
        """Objects an earlier run with this run_id left in S3 (a local store lives in the run
        directory). A new run would resume from its checkpoints: refused unless --overwrite
        (or --resume, which continues from them)."""
        store = store_from_env(self.config.run_id, str(self.run_dir / "store"))
        stale = [] if isinstance(store, LocalStore) or self.resume else store.list()
        if stale and not self.overwrite:
            raise RunAborted(f"the object store already holds {len(stale)} objects of run "
                             f"{self.config.run_id!r}; pass --overwrite to replace them or "
                             "change run_id")
        return store, stale

    def _spawn(self, role: str, name: str, port: int,
               extra_env: dict[str, str] | None = None) -> Child:
        log_path = self.run_dir / "logs" / f"{name}.log"
        training = self.config.training

        def launch() -> ProcessHandle:
            # A fresh command each time: a restarted torchrun gets a fresh rendezvous port.
            command = service_command(role, training.processes, training.max_restarts)
            args = [*command.argv, "serve", role,
                    "--config", str(self.resolved_config), "--instance", name,
                    "--port", str(port), "--work-dir", str(self.run_dir / "work" / name)]
            env = {**self.env, **command.env, **self.placement.env(name), **(extra_env or {})}
            if self.warm is not None and role in WARM_ROLES and command.argv == PLAIN_SERVICE:
                try:
                    return self.warm.spawn(args, env, log_path)
                except WarmStartError as error:
                    console.print(f"[yellow]warning:[/] {name} starts cold: {error}")
            with open(log_path, "ab") as log:
                return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env,
                                        start_new_session=True, preexec_fn=die_with_parent)

        child = Child(name, role, port, launch(), log_path, launch)
        self.children.append(child)
        self.supervisor.add(child)
        return child

    def gpu_placement(self) -> Placement:
        """Each process's GPUs (launcher/placement.py), from the GPUs this machine shows the
        run (``CUDA_VISIBLE_DEVICES``, ``nvidia-smi -L``, ``ANCE_GPU_COUNT``)."""
        partitions = self.config.index.partitions
        try:
            gpus = visible_gpus(self.env)
        except ValueError as error:  # a malformed ANCE_GPU_COUNT
            raise RunAborted(str(error)) from None
        return place(gpus, self.config.training.processes,
                     [f"inferencer-{r}" for r in range(self.config.inference.replicas)],
                     ["indexer"] if partitions == 1 else [f"indexer-{p}"
                                                          for p in range(partitions)],
                     index_on_gpu=self.config.index.device != "cpu")

    def start_services(self) -> None:
        ports = self.config.services
        partitions = self.config.index.partitions
        self.placement = self.gpu_placement()
        for line in self.placement.describe():
            console.print(line)
        if self.config.services.warm_start and not self.placement.gpus:
            self.warm = WarmStarter(self.env, self.run_dir / "logs" / "zygote.log",
                                    str(self.run_dir), self.encoder_type,
                                    server=self.env.get(SERVER_VAR)).start()
            source = (f"the warm-start server {self.env[SERVER_VAR]} ({SERVER_VAR})"
                      if self.warm.shared else "one process that imports torch and "
                      "transformers once (its log: logs/zygote.log)")
            console.print(f"warm start: the trainer and inferencers are forked from {source} "
                          "(services.warm_start)")
        if partitions == 1:
            self.indexer = self._spawn("indexer", "indexer", ports.indexer_port or free_port())
        else:  # one process per partition; partition 0 merges and announces (indexer-0)
            indexers = [self._spawn("indexer", f"indexer-{p}",
                                    ports.indexer_port + p if ports.indexer_port else free_port(),
                                    {PARTITION_VAR: str(p)}) for p in range(partitions)]
            self.indexer = indexers[0]
        for replica in range(self.config.inference.replicas):
            base = ports.inferencer_base_port
            self._spawn("inferencer", f"inferencer-{replica}",
                        base + replica if base else free_port())
        self.trainer = self._spawn("trainer", "trainer", ports.trainer_port or free_port())
        self.supervisor.start()

    # -- monitoring -----------------------------------------------------------------------
    def refreshes(self, on_wait: Callable[[], None] | None = None) -> Iterator[dict]:
        """Each refresh's evaluation as it arrives (``step``, ``metrics``, ``timings``,
        ``elapsed_s``), until the final checkpoint is evaluated; raises :class:`RunAborted`
        if a service crashes beyond its restart budget or ``max_minutes`` passes.
        ``on_wait`` is called between polls.
        The CLI (:meth:`monitor`) and the Python API (:class:`ance_train.api.Run`) both read
        the run through this."""
        assert self.redis is not None
        bus = EventBus(connect(self.redis_url), self.config.run_id)
        started = time.monotonic()
        deadline = None if self.max_minutes is None else started + self.max_minutes * 60
        cursor = "0"
        final_step: int | None = None
        evaluated: set[int] = set()
        while True:
            self._check_children()
            try:
                arrived = list(bus.read_all(EvalCompleted, after=cursor, block_ms=1000))
                if final_step is None:
                    finished = list(bus.history(RunFinished))
                    if finished:
                        final_step = finished[-1].event.step
            except REDIS_UNAVAILABLE:  # Redis down: the supervisor restarts it
                arrived = []
                time.sleep(0.5)
            for received in arrived:
                cursor = received.entry_id
                evaluated.add(received.event.step)
                yield {"step": received.event.step, "metrics": received.event.metrics,
                       "timings": received.event.timings,
                       "elapsed_s": time.monotonic() - started}
            if final_step is not None and final_step in evaluated:
                self.finished = True
                return
            if on_wait is not None:
                on_wait()
            if deadline is not None and time.monotonic() > deadline:
                raise RunAborted(f"run exceeded --max-minutes {self.max_minutes}")

    def monitor(self) -> RunResult:
        """:meth:`refreshes` with a progress bar and the metrics table (the CLI)."""
        result = RunResult()
        started = time.monotonic()
        table = _metrics_table(self.config)
        progress = Progress(TextColumn("[bold]train"), BarColumn(),
                            TextColumn("{task.description}"), TimeElapsedColumn(),
                            console=console, transient=False)
        task = progress.add_task("starting", total=self.config.training.total_steps)

        def show_progress() -> None:
            progress.update(task, completed=self._trainer_step(),
                            description=self._describe_refresh())

        with progress:
            for entry in self.refreshes(on_wait=show_progress):
                result.evaluations.append(entry)
                table.add_row(*_metrics_row(entry))
                progress.console.print(_metrics_line(entry))
            progress.update(task, completed=self.config.training.total_steps, description="done")
        result.seconds = time.monotonic() - started
        result.trainer_summary = self.store.get_json(keys.TRAINER_SUMMARY)
        result.restarts = self.supervisor.records()
        console.print(table)
        return result

    def _trainer_step(self) -> int:
        try:
            return int(fetch_status(self.trainer.address, timeout_s=0.5).step)
        except Exception:
            return 0

    def _describe_refresh(self) -> str:
        try:
            reply = fetch_status(self.indexer.address, timeout_s=0.5)
            trainer = fetch_status(self.trainer.address, timeout_s=0.5)
        except Exception:
            return "starting services"
        loss = trainer.metrics.get("loss")
        loss_text = f"loss {loss:.3f}" if loss is not None else "waiting"
        return (f"step {trainer.step} {loss_text} | negatives from ckpt {trainer.index_step} | "
                f"indexer: {reply.progress.phase}")

    def _check_children(self) -> None:
        """Abort if a service crashed beyond its restart budget (the supervisor restarts the
        others); the trainer alone may exit (with 0) when it finishes."""
        try:
            self.supervisor.check()
        except CrashLoop as error:
            raise RunAborted(str(error)) from None

    # -- tear-down ------------------------------------------------------------------------
    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop every service, sweep the store once more and stop Redis; idempotent (``Run``
        stops when its iteration ends and again when its ``with`` block does: a second final
        sweep would only find Redis gone and retry it for minutes)."""
        if self.stopped:
            return
        self.stopped = True
        self.supervisor.pause()
        try:
            self._stop(timeout_s)
        finally:
            if self.warm is not None:  # after the services: they die with it
                self.warm.close()
            # last: the processes it restarted die with its thread (supervisor.py)
            self.supervisor.close()

    def _stop(self, timeout_s: float) -> None:
        if self.finished:
            self._let_trainer_exit(timeout_s)
        for child in self.children:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
                with suppress(ProcessLookupError, PermissionError):  # a stopped one hears it
                    os.killpg(child.process.pid, signal.SIGCONT)
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            try:
                child.process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        if self.redis is not None:
            try:
                self._retain()
            except (*REDIS_UNAVAILABLE, StorageError) as error:  # never masks the run's end
                console.print(f"[yellow]warning:[/] final store retention failed: {error}")
            finally:
                self.redis.stop()
        self._abort_unfinished_uploads()

    def _abort_unfinished_uploads(self) -> None:
        """Uploads a killed or cut-off service left open in S3 (found by bench/chaos.py):
        now that no service runs, none is in flight."""
        store = getattr(self, "store", None)
        if store is None:
            return
        try:
            aborted = store.abort_unfinished_uploads()
        except StorageError as error:  # never masks the run's end
            console.print(f"[yellow]warning:[/] aborting unfinished uploads failed: {error}")
            return
        if aborted:
            console.print(f"aborted {len(aborted)} unfinished upload(s) that stopped services "
                          f"left in the store: {', '.join(aborted[:5])}")

    def _retain(self) -> None:
        """``store.keep_refreshes`` / ``keep_checkpoints`` once more, now that no service can
        read anything: the services sweep after their own refreshes and checkpoints, so the
        last ones (the final refresh, the final checkpoint) are only swept here. The rules are
        the services' (infra/retention.py), with the trainer's last announcement."""
        store_cfg = self.config.store
        if store_cfg.keep_refreshes is None and store_cfg.keep_checkpoints is None:
            return
        retention = RunRetention(EventBus(connect(self.redis_url), self.config.run_id),
                                 self.store, store_cfg.keep_refreshes,
                                 store_cfg.keep_checkpoints)
        retention.sweep_refreshes()
        retention.sweep_checkpoints()

    def _let_trainer_exit(self, timeout_s: float) -> None:
        """A finished trainer exits by itself moments after its last checkpoint: let it, rather
        than signal it. A signalled torch.distributed.run (``training.processes`` > 1) stops its
        ranks but raises ``SignalException`` and logs the traceback, as it does when a run is
        aborted (Ctrl-C, a failed service): there the traceback is torch's record of a stop."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return
        try:
            trainer.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            console.print(f"[yellow]warning:[/] the trainer finished but had not exited after "
                          f"{timeout_s:g}s: stopping it")

    def execute(self) -> RunResult:
        self.prepare()
        try:
            self.start_services()
            result = self.monitor()
        finally:
            self.stop()
        result.store_bytes = self.store.usage()
        write_summary(self.run_dir, result)
        print_summary(result, self.run_dir)
        return result


# The environment of torch.distributed.run for the ranks to survive a restart. By default its
# agent keeps one TCPStore for the processes' ``init_process_group`` across every restart
# (the static rendezvous always does), so a restarted group reads the gloo addresses its dead
# predecessors left there: "Connection refused" on the first restart, a hang on the second
# (both seen in tests/test_rank_failure.py; pytorch/pytorch#135712). With this, rank 0 of
# each new group hosts a fresh store.
RANKS_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class ServiceCommand(NamedTuple):
    """How to start a service process: its argv (``serve ROLE ...`` follows) and the
    environment variables the launcher itself needs, laid over the caller's environment."""

    argv: list[str]
    env: dict[str, str]


# The services that import torch and transformers, and so start from the zygote
# (services.warm_start); the indexer imports neither and starts cold in a second.
WARM_ROLES = ("trainer", "inferencer")
PLAIN_SERVICE = [sys.executable, "-m", "ance_train.cli"]


def service_command(role: str, trainer_processes: int = 1, max_restarts: int = 3
                    ) -> ServiceCommand:
    """How a service process starts: ``python -m ance_train.cli``, or for a data-parallel
    trainer torch's elastic launcher starting ``trainer_processes`` ranks of it on this machine
    (rank 0 is the trainer the others see: trainer/distributed.py, trainer/trainer.py). When
    a rank fails, the launcher stops the others and starts all of them again, up to
    ``max_restarts`` times (``training.max_restarts``); they resume from the newest complete
    checkpoint.

    The ranks meet through the c10d rendezvous, as in the chart, and need :data:`RANKS_ENV`
    to survive a restart: it comes with the command, so no caller can forget it."""
    if role != "trainer" or trainer_processes == 1:
        return ServiceCommand(list(PLAIN_SERVICE), {})
    return ServiceCommand(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
         "--nproc-per-node", str(trainer_processes), "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", str(max_restarts),
         "-m", "ance_train.cli"],
        dict(RANKS_ENV))


def _metrics_table(config: RunConfig) -> Table:
    table = Table(title="evaluation after each refresh")
    table.add_column("checkpoint", justify="right")
    for split in config.index.eval_splits:
        for name in SHOWN_METRICS:
            table.add_column(f"{split} {name}", justify="right")
    table.add_column("elapsed", justify="right")
    return table


def _metrics_row(entry: dict) -> list[str]:
    label = "0 (zero-shot)" if entry["step"] == 0 else str(entry["step"])
    row = [label]
    for split_metrics in entry["metrics"].values():
        row += [f"{split_metrics[name]:.4f}" for name in SHOWN_METRICS]
    row.append(f"{entry['elapsed_s'] / 60:.1f} min")
    return row


def _metrics_line(entry: dict) -> str:
    parts = [f"checkpoint {entry['step']}" + (" (zero-shot)" if entry["step"] == 0 else "")]
    for split, values in entry["metrics"].items():
        parts.append(f"{split} nDCG@10 {values['ndcg@10']:.4f} MRR@10 {values['mrr@10']:.4f} "
                     f"R@100 {values['recall@100']:.4f}")
    return " | ".join(parts)


def write_summary(run_dir: Path, result: RunResult) -> None:
    (run_dir / "summary.json").write_text(json.dumps({
        "seconds": result.seconds, "evaluations": result.evaluations,
        "store_bytes": result.store_bytes, "restarts": result.restarts,
        "trainer": result.trainer_summary}, indent=2))


def print_summary(result: RunResult, run_dir: Path) -> None:
    trainer = result.trainer_summary
    refreshes = [e for e in result.evaluations if e["step"] > 0]
    gaps = [g for g in trainer.get("async_gaps", []) if g is not None]
    console.print(f"[bold]run finished[/] in {result.seconds / 60:.1f} min: "
                  f"{trainer.get('steps', 0)} steps, {len(refreshes)} refreshes after zero-shot, "
                  f"{len(trainer.get('swaps', []))} negative swaps, "
                  f"mean async gap {sum(gaps) / len(gaps) if gaps else 0:.1f} steps")
    if result.evaluations:
        first, last = result.evaluations[0], result.evaluations[-1]
        for split in last["metrics"]:
            console.print(f"{split} nDCG@10: zero-shot {first['metrics'][split]['ndcg@10']:.4f} "
                          f"→ final {last['metrics'][split]['ndcg@10']:.4f}")
    if result.restarts:
        restarted = Counter(r["service"] for r in result.restarts)
        console.print(f"restarts: {len(result.restarts)} ("
                      + ", ".join(f"{name} ×{n}" for name, n in sorted(restarted.items()))
                      + "): summary.json lists each")
    if result.store_bytes is not None:
        console.print(f"store: {result.store_bytes / 2**20:.1f} MiB (store.keep_refreshes, "
                      "store.keep_checkpoints bound it)")
    console.print(f"checkpoints, negatives and metrics under {run_dir}")
    console.print(f"TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}")
