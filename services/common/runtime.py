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
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from . import events
from .config import RunConfig, load_config
from .data import Corpus, DatasetFiles, DatasetIndex, load_dataset_index
from .rpc import GrpcServer, ServiceState
from .storage import ObjectStore, store_from_env

DATASET_INDEX_KEY = "data/dataset.json"
DOC_OFFSETS_KEY = "data/doc_offsets.npy"
DATASET_INDEX_FILE = "dataset.json"
DOC_OFFSETS_FILE = "doc_offsets.npy"


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
    level = os.environ.get("ANCE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {role}[{instance}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    for noisy in ("urllib3", "filelock", "httpx", "transformers", "faiss.loader"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def publish_dataset(store: ObjectStore, cache_dir: Path) -> None:
    """Make the validated dataset index available to every service through the store."""
    store.put_file(DOC_OFFSETS_KEY, cache_dir / DOC_OFFSETS_FILE)
    store.put_file(DATASET_INDEX_KEY, cache_dir / DATASET_INDEX_FILE)


def fetch_dataset(store: ObjectStore, cache_dir: Path) -> DatasetIndex:
    cache_dir.mkdir(parents=True, exist_ok=True)
    store.get_file(DOC_OFFSETS_KEY, cache_dir / DOC_OFFSETS_FILE)
    store.get_file(DATASET_INDEX_KEY, cache_dir / DATASET_INDEX_FILE)
    return load_dataset_index(cache_dir)


class ServiceContext:
    """Everything a service needs, built once at start-up."""

    def __init__(self, options: ServiceOptions) -> None:
        self.options = options
        setup_logging(options.role, options.instance)
        self.log = logging.getLogger(f"ance_train.{options.role}")
        self.config: RunConfig = load_config(options.config_path)
        self.work_dir = Path(options.work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.store: ObjectStore = store_from_env(self.config.run_id, options.store_dir)
        self.redis = events.connect(options.redis_url)
        events.wait_for_redis(self.redis)
        self.bus = events.EventBus(self.redis, self.config.run_id)
        self.state = ServiceState(options.role, self.config.run_id, options.instance)
        self.stop = threading.Event()
        self.dataset: DatasetIndex = fetch_dataset(self.store, self.work_dir / "data")
        self.corpus = Corpus(DatasetFiles.resolve(self.config.data),
                             self.work_dir / "data" / DOC_OFFSETS_FILE, self.config.data.format)
        self.server: GrpcServer | None = None

    def install_signal_handlers(self) -> None:
        def _stop(signum: int, _frame: object) -> None:
            self.log.info("received %s, stopping", signal.Signals(signum).name)
            self.stop.set()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)

    def start_server(self, add_servicers: Callable[[grpc.Server], None] | None = None) -> None:
        self.server = GrpcServer(self.state, self.options.grpc_port, self.options.grpc_host,
                                 add_servicers).start()
        threading.Thread(target=self._heartbeat, name="registry", daemon=True).start()
        self.log.info("gRPC on %s", self.server.address)

    def _heartbeat(self) -> None:
        assert self.server is not None
        advertised = os.environ.get("ANCE_ADVERTISE_ADDRESS", self.server.address)
        while not self.stop.is_set():
            try:
                self.bus.register(self.options.role, self.options.instance, advertised)
            except Exception as error:  # Redis may be restarting; the next beat retries
                self.log.warning("registry heartbeat failed: %s", error)
            self.stop.wait(5.0)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()

    def serve(self, main: Callable[[], object],
              add_servicers: Callable[[grpc.Server], None] | None = None) -> int:
        """Run a service: signals, gRPC server, then ``main`` until it returns or is stopped."""
        self.install_signal_handlers()
        self.start_server(add_servicers)
        try:
            main()
        finally:
            self.close()
        return 0
