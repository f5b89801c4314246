"""What every service process sets up the same way: config, Redis, object store, dataset,
gRPC server, service registry, logging and clean shutdown on SIGTERM/SIGINT.

Endpoints come from flags or environment variables (see ``ance_train.cli``), so the same
code runs in the embedded mode and in Kubernetes.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, Unpack

import grpc
from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, wait_exponential

from ance_train.config import RunConfig, load_config, resolve_budget
from ance_train.data.corpus import Corpus, open_corpus
from ance_train.data.dataset import DatasetIndex, load_dataset_index
from ance_train.data.validation import validate_dataset
from ance_train.infra import bus
from ance_train.infra.credentials import RedactingFormatter, cluster_mode, redact_url
from ance_train.infra.process import exit_after_grace, termination_grace_s
from ance_train.infra.rpc import GrpcServer, ServiceState
from ance_train.infra.store import ObjectStore, store_from_env
from ance_train.infra.workdir import claim_work_dir
from ance_train.observability.kube import RunReporter
from ance_train.observability.metrics import metrics_port, start_metrics_server
from ance_train.protocol import keys

DATASET_TIMEOUT_VAR = "ANCE_DATASET_TIMEOUT_S"
HF_PROGRESS_BARS_OFF = "HF_HUB_DISABLE_PROGRESS_BARS"  # huggingface_hub's, read by transformers
DEFAULT_DATASET_TIMEOUT_S = 3600.0


class DatasetNotPublished(RuntimeError):
    """The dataset index did not appear in the store in time."""


@dataclass(frozen=True)
class ServiceOptions:
    role: str
    config_path: str
    redis_url: str
    work_dir: str
    instance: str = field(default_factory=socket.gethostname)
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 0
    store_dir: str | None = None


def setup_logging(role: str, instance: str) -> None:
    """Log lines name the role and instance, and, in a process that torch.distributed.run
    started as one of several ranks (``WORLD_SIZE`` > 1), the rank: the ranks share a log."""
    level = os.environ.get("ANCE_LOG_LEVEL", "INFO").upper()
    world = os.environ.get("WORLD_SIZE", "1")
    label = (f"{instance} rank {os.environ.get('RANK', '?')}/{world}"
             if world.isdigit() and int(world) > 1 else instance)
    handler = logging.StreamHandler()
    handler.setFormatter(RedactingFormatter(
        f"%(asctime)s {role}[{label}] %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for noisy in ("urllib3", "filelock", "httpx", "transformers", "faiss.loader"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # No progress bars in service logs. transformers reads this variable when it is first
    # imported; setting it instead of importing transformers here keeps the indexer, which
    # needs no model unless it serves a text query, from paying ~1 s per start for it.
    os.environ[HF_PROGRESS_BARS_OFF] = "1"
    if "huggingface_hub" in sys.modules:  # imported already: the variable was read
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def publish_dataset(store: ObjectStore, cache_dir: Path) -> None:
    """Make the validated dataset index available to every service through the store."""
    store.put_file(keys.DOC_OFFSETS, cache_dir / keys.DOC_OFFSETS_FILE)
    store.put_file(keys.DATASET_INDEX, cache_dir / keys.DATASET_INDEX_FILE)


def prepare_dataset(config: RunConfig, store: ObjectStore, cache_dir: Path) -> DatasetIndex:
    """Validate the run's dataset into ``cache_dir`` and publish its index (idempotent: the
    same data gives the same objects)."""
    dataset = validate_dataset(config.data, cache_dir, seed=config.data.split_seed)
    publish_dataset(store, cache_dir)
    return dataset


def dataset_timeout_s() -> float:
    raw = os.environ.get(DATASET_TIMEOUT_VAR, "").strip()
    try:
        timeout = float(raw) if raw else DEFAULT_DATASET_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{DATASET_TIMEOUT_VAR} must be a number of seconds, got {raw!r}"
                         ) from None
    if timeout <= 0:
        raise ValueError(f"{DATASET_TIMEOUT_VAR} must be positive, got {raw!r}")
    return timeout


def wait_for_dataset(store: ObjectStore, timeout_s: float, log: logging.Logger) -> None:
    """Poll with backoff until the dataset index is in the store (in a cluster the services
    start while the trainer pod's ``ance-train prepare`` is still publishing it)."""
    if store.exists(keys.DATASET_INDEX):
        return
    log.info("waiting for the dataset index %s in %r (published by `ance-train prepare`)",
             keys.DATASET_INDEX, store)
    poll = Retrying(retry=retry_if_result(lambda found: not found),
                    wait=wait_exponential(multiplier=0.5, max=10.0),
                    stop=stop_after_delay(timeout_s))
    try:
        poll(store.exists, keys.DATASET_INDEX)
    except RetryError:
        raise DatasetNotPublished(
            f"no dataset index ({keys.DATASET_INDEX}) in {store!r} after {timeout_s:g}s: run "
            f"`ance-train prepare` (the trainer pod's init container), or raise "
            f"{DATASET_TIMEOUT_VAR}") from None
    log.info("dataset index found")


def connect_context(options: ServiceOptions) -> ServiceContext:
    """Set up a service process: logging, config, metrics, object store, Redis, dataset."""
    setup_logging(options.role, options.instance)
    log = logging.getLogger(f"ance_train.{options.role}")
    config = load_config(options.config_path)
    work_dir = claim_work_dir(Path(options.work_dir), options.role)
    reporter = RunReporter.from_env(options.role, options.instance).start()
    port = metrics_port()
    if port:
        start_metrics_server(options.role, port)
        log.info("Prometheus metrics on :%d/metrics", port)
    store = store_from_env(config.run_id, options.store_dir)
    log.info("object store %r, Redis %s", store, redact_url(options.redis_url))
    client = bus.connect(options.redis_url)
    bus.wait_for_redis(client)
    wait_for_dataset(store, dataset_timeout_s(), log)
    dataset = fetch_dataset(store, work_dir / "data")
    config = resolve_budget(config, dataset.trainable_queries)  # training.epochs → steps
    corpus = open_corpus(config.data, work_dir / "data")
    return ServiceContext(options=options, config=config, log=log, work_dir=work_dir,
                          store=store, redis=client, bus=bus.EventBus(client, config.run_id),
                          dataset=dataset, corpus=corpus, reporter=reporter)


def fetch_dataset(store: ObjectStore, cache_dir: Path) -> DatasetIndex:
    cache_dir.mkdir(parents=True, exist_ok=True)
    store.get_file(keys.DOC_OFFSETS, cache_dir / keys.DOC_OFFSETS_FILE)
    store.get_file(keys.DATASET_INDEX, cache_dir / keys.DATASET_INDEX_FILE)
    return load_dataset_index(cache_dir)


def ranks_restart_on_failure() -> bool:
    """Whether torch.distributed.run starts this process's group of ranks again if it fails
    now: several ranks, and its ``--max-restarts`` not used up (the variables it sets)."""
    try:
        return (int(os.environ.get("WORLD_SIZE", "1")) > 1
                and int(os.environ["TORCHELASTIC_RESTART_COUNT"])
                < int(os.environ["TORCHELASTIC_MAX_RESTARTS"]))
    except (KeyError, ValueError):
        return False


# Exit code of a Job's trainer stopped (SIGTERM) before its last step: not a success, so
# Kubernetes starts it again and it resumes from its newest checkpoint (128 + SIGTERM).
STOPPED_EARLY = 143


class ServerLimits(TypedDict, total=False):
    """:class:`GrpcServer`'s limits a service may set (the indexer's, from ``index.search``)."""

    max_message_bytes: int
    max_concurrent_rpcs: int | None


@dataclass
class ServiceContext:
    """Everything a service needs: a plain object, so a test about a loop's logic can build
    one from in-memory fakes of the bus and the store. Services get theirs from
    :func:`connect_context`, which does the I/O (config, store, Redis, dataset)."""

    options: ServiceOptions
    config: RunConfig
    log: logging.Logger
    work_dir: Path
    store: ObjectStore
    redis: Any
    bus: bus.EventBus
    dataset: DatasetIndex
    corpus: Corpus
    reporter: RunReporter = field(default_factory=RunReporter.disabled)
    state: ServiceState = field(init=False)
    stop: threading.Event = field(default_factory=threading.Event)
    server: GrpcServer | None = None

    def __post_init__(self) -> None:
        self.state = ServiceState(self.options.role, self.config.run_id, self.options.instance)

    def install_signal_handlers(self) -> None:
        grace_s = termination_grace_s()

        def _stop(signum: int, _frame: object) -> None:
            self.log.info("received %s, stopping", signal.Signals(signum).name)
            if not self.stop.is_set():
                exit_after_grace(self.log, grace_s, 128 + signum)
            self.stop.set()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)

    def start_server(self, add_servicers: Callable[[grpc.Server], None] | None = None,
                     **limits: Unpack[ServerLimits]) -> None:
        """``limits``: :class:`GrpcServer`'s ``max_message_bytes`` / ``max_concurrent_rpcs``."""
        self.server = GrpcServer(self.state, self.options.grpc_port, self.options.grpc_host,
                                 add_servicers, **limits).start()
        threading.Thread(target=self._heartbeat, name="registry", daemon=True).start()
        self.log.info("gRPC on %s", self.server.address)

    def _heartbeat(self) -> None:
        assert self.server is not None
        advertised = os.environ.get("ANCE_ADVERTISE_ADDRESS", self.server.address)
        while not self.stop.is_set():
            try:
                self.bus.register(self.options.role, self.options.instance, advertised)
            except bus.REDIS_UNAVAILABLE as error:  # the next beat retries
                self.log.warning("registry heartbeat failed: %s", error)
            self.stop.wait(5.0)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()

    def run(self, serve_role: Callable[[ServiceContext], int]) -> int:
        """Run the role; an unhandled exception is logged and reported (exit code 1).
        What is queued for the AnceRun is sent before the process ends."""
        try:
            return serve_role(self)
        except Exception as error:
            self.log.error("%s failed", self.options.role, exc_info=error)
            self.reporter.failed(error, restarting=ranks_restart_on_failure())
            return 1
        finally:
            self.reporter.close()

    def serve(self, main: Callable[[], object],
              add_servicers: Callable[[grpc.Server], None] | None = None,
              finishes: bool = False, **limits: Unpack[ServerLimits]) -> int:
        """Run a service: signals, gRPC server, then ``main`` until it returns or is stopped.

        ``finishes``: the role ends by itself (the trainer, a Kubernetes Job). In the cluster
        it exits 0 only when ``main`` returned without being stopped, and
        :data:`STOPPED_EARLY` when stopped, so that the Job runs it again. The other roles
        are Deployments, which restart a pod whose process exits: there a finished service
        stays up, still answering Status and health, until the release is uninstalled.
        """
        self.install_signal_handlers()
        self.start_server(add_servicers, **limits)
        try:
            main()
            if cluster_mode() and finishes and self.stop.is_set():
                self.log.info("%s stopped before it finished", self.options.role)
                return STOPPED_EARLY
            if cluster_mode() and not finishes and not self.stop.is_set():
                self.log.info("%s finished; serving status until stopped", self.options.role)
                self.stop.wait()
        finally:
            self.close()
        return 0
