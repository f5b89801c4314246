"""Starting single services as OS processes against a real Redis and store, for tests.

A trainer or inferencer is forked from one warm-start server per test process
(:func:`start_warm_start_server`, ``python -m ance_train.launcher.zygote --listen``): it
imported torch and transformers once, where every cold start would spend 4-6 CPU-s doing it.
tests/conftest.py starts it and sets ``ANCE_WARM_START_SERVER``, so the embedded runs the tests
launch (``ance-train run``, bench/quality.py, ...) fork their services from it too instead of
each starting a zygote of its own. The indexer, and a service whose environment differs from
the server's in what is read at import time (Hugging Face Hub settings, say), start cold.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
import yaml

from ance_train.config import load_config
from ance_train.data.validation import validate_dataset
from ance_train.infra.bus import EventBus
from ance_train.infra.store import LocalStore, ObjectStore, S3Store
from ance_train.launcher.embedded import PLAIN_SERVICE, WARM_ROLES
from ance_train.launcher.warm_start import (
    SERVER_VAR,
    ProcessHandle,
    WarmStarter,
    WarmStartError,
    run_zygote,
)
from ance_train.runtime import publish_dataset

_zygote: WarmStarter | None = None


def start_warm_start_server(encoder_type: str = "bert") -> subprocess.Popen:
    """Start this test process's warm-start server and name it in ``ANCE_WARM_START_SERVER``
    for every launcher started from here on; it is stopped at exit, and dies with this
    process (PDEATHSIG), its children with it."""
    path = Path(tempfile.gettempdir()) / f"ance-warm-{os.getpid()}.sock"
    log = _zygote_log()
    server = run_zygote(["--listen", str(path)], dict(os.environ), log,
                        f"test process {os.getpid()}", encoder_type)

    def stop() -> None:
        server.terminate()
        server.wait()
        path.unlink(missing_ok=True)

    atexit.register(stop)
    # Bound before its imports: from then on a launcher connecting waits for it.
    wait_until(lambda: path.exists() or server.poll() is not None, 60,
               f"the warm-start server's socket {path}")
    if server.poll() is not None:
        raise RuntimeError(f"the warm-start server ended ({server.returncode}): see {log}")
    os.environ[SERVER_VAR] = str(path)
    return server


def _zygote_log() -> Path:
    """This test process's zygote log (the server's, or the zygote it starts without one)."""
    return Path(tempfile.gettempdir()) / f"ance-test-zygote-{os.getpid()}.log"


def shared_zygote() -> WarmStarter:
    """This test process's warm-start server (its own zygote when none runs), connected on
    first use and closed at its exit."""
    global _zygote
    if _zygote is None:
        _zygote = WarmStarter(dict(os.environ), _zygote_log(), f"test process {os.getpid()}",
                              encoder_type="bert", server=os.environ.get(SERVER_VAR)).start()
        atexit.register(_zygote.close)
    return _zygote


@dataclass
class Harness:
    """A prepared run: validated dataset in the store, config file, Redis URL.

    The store is a local directory, or S3 when ``store_env`` holds ``ANCE_S3_*`` variables.
    """

    root: Path
    config_path: Path
    redis_url: str
    store_env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def prepare(cls, root: Path, redis_url: str, *, store_env: dict[str, str] | None = None,
                **sections: dict) -> Harness:
        config_path = root / "config.yaml"
        config_path.write_text(yaml.safe_dump(sections, sort_keys=False))
        config = load_config(config_path)
        validate_dataset(config.data, root / "cache", seed=config.data.split_seed)
        harness = cls(root, config_path, redis_url, dict(store_env or {}))
        publish_dataset(harness.store, root / "cache")
        return harness

    @property
    def config(self):
        return load_config(self.config_path)

    @property
    def store(self) -> ObjectStore:
        if not self.store_env:
            return LocalStore(self.config.run_id, self.root / "store")
        env = self.store_env
        return S3Store(self.config.run_id, env["ANCE_S3_ENDPOINT"], env["ANCE_S3_ACCESS_KEY"],
                       env["ANCE_S3_SECRET_KEY"], env["ANCE_S3_BUCKET"])

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ANCE_S3_")}
        env.update(ANCE_STORE_DIR=str(self.root / "store"), ANCE_REDIS_URL=self.redis_url,
                   TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        env.update(self.store_env)
        return env

    def spawn(self, role: str, instance: str,
              extra_env: dict[str, str] | None = None) -> ProcessHandle:
        """Start ``ance-train serve role``; ``extra_env`` adds to (or overrides) ``env()``.
        A trainer or inferencer is forked from :func:`shared_zygote` (module docstring)."""
        argv = [*PLAIN_SERVICE, "serve", role, "--config", str(self.config_path),
                "--instance", instance, "--work-dir", str(self.root / "work" / instance)]
        env = {**self.env(), **(extra_env or {})}
        log_path = self.root / f"{instance}.log"
        if role in WARM_ROLES:
            try:
                return shared_zygote().spawn(argv, env, log_path)
            except WarmStartError:  # an environment the server's imports did not read
                pass
        with open(log_path, "ab") as log:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)

    def log(self, instance: str) -> str:
        return (self.root / f"{instance}.log").read_text(errors="replace")


def checkpoint_steps(bus, event_type: type) -> list[int]:
    """The checkpoint steps of every ``event_type`` event so far (the BM25 table, which no
    checkpoint mined, left out)."""
    return [e.step for e in bus.history(event_type) if e.step is not None]


def three_checkpoint_sections(run_id: str, data: Path, model: Path, negatives: dict,
                              **inference: object) -> dict:
    """A 6-step run with checkpoints 0, 3 and 6 over the test subset and the tiny model."""
    return {
        "run_id": run_id,
        "data": {"path": str(data), "dev_fraction": 0.2},
        "model": {"path": str(model), "max_query_length": 16, "max_doc_length": 32},
        "training": {"steps": 6, "batch_size": 8, "refresh_every": 3, "torch_threads": 1},
        "negatives": negatives,
        "inference": {"shard_size": 100, "claim_timeout_s": 30, "torch_threads": 1,
                      **inference},
        "index": {"eval_depth": 100},
    }


def wait_until(predicate, timeout_s: float, message: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s: {message}")


def wait_registered(harness: Harness, bus, process: ProcessHandle, role: str,
                    instance: str, timeout_s: float = 120.0) -> None:
    """Until the service registers itself in Redis; fails at once, with its log, if it exits."""
    wait_until(lambda: f"{role}:{instance}" in bus.services() or process.poll() is not None,
               timeout_s, f"{role} {instance} registered")
    assert process.poll() is None, harness.log(instance)


def registered_services(run_dir: Path, run_id: str, password: str | None = None
                        ) -> dict[str, str]:
    """The services registered so far in the private Redis of the ``ance-train run`` in
    ``run_dir`` ({} while it is not up). Read in this process: a cheap check to make before
    running ``ance-train status``, which costs a second of CPU per call."""
    try:
        url = json.loads((run_dir / "endpoints.json").read_text())["redis_url"]
    except (OSError, ValueError, KeyError):
        return {}
    client = redis.Redis.from_url(url, password=password, decode_responses=True,
                                  socket_timeout=2)
    try:
        return EventBus(client, run_id).services()
    except redis.RedisError:
        return {}
    finally:
        client.close()


def stop(process: ProcessHandle, timeout_s: float = 10.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def processes_mentioning(text: str) -> list[str]:
    """Live processes (other than this one) whose command line contains ``text``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline and int(pid) != os.getpid():
            found.append(f"{pid}: {cmdline[:120]}")
    return found
