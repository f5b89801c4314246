"""Fixtures that start real servers: Redis (redis-server process) and S3 (moto server), and
how pytest-xdist shares the tests out.

``scripts/test.sh`` runs ``-n 2 --dist loadgroup``. Each worker picks ports from its own
slice (``ANCE_PORT_RANGE``, inherited by the servers and launchers it starts). The units of
work are single tests, except that:

* the fault-injection tests (marked ``fault``) are one unit: they run one after another on
  one worker, as ``bench/reliability.py`` runs them, so their outages and timings never
  overlap one another;
* a module whose tests share one module-scoped run is one unit (that run happens once).

Each worker starts a warm-start server (``ANCE_WARM_START_SERVER``) that the services of its
tests and of the runs they launch are forked from.

Larger units go out first, then the slow single tests, then the rest.

The controller that hands out the units collects nothing itself, so it goes by module
(``WORK_UNITS``); every worker checks at collection that each ``fault`` test lies in a
module of the ``fault`` unit. (xdist's own ``loadgroup`` reads ``xdist_group`` marks through
a suffix it writes into node ids, which pytest 9.2 no longer takes: pytest-xdist#1386.)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ance_train.infra.bus import EventBus, connect
from ance_train.launcher.redis_server import RedisServer

from ance_train_dev.helpers import make_scifact_subset, make_tiny_bert
from ance_train_dev.servers import moto_server, use_worker_port_range
from ance_train_dev.service_harness import start_warm_start_server

FAULT_MODULES = ("test_duplicate_events.py", "test_fault_corrupt_checkpoint.py",
                 "test_fault_corrupt_shard.py", "test_fault_redis_restart.py",
                 "test_fault_store_outage.py", "test_indexer_restart.py",
                 "test_partition_restart.py", "test_rank_failure.py",
                 "test_shard_reclaim.py", "test_trainer_restart.py")
SHARED_RUN_MODULES = ("test_e2e.py", "test_kube_status.py", "test_distributed.py",
                      "test_index_partitions.py", "test_maxp_e2e.py")
WORK_UNITS = {**dict.fromkeys(FAULT_MODULES, "fault"),
              **{name: name for name in SHARED_RUN_MODULES}}
# Slow single tests are handed out first (after the larger units), so that a run ends on short
# tests on every worker. A stale entry here costs only speed.
SLOW_FIRST_MODULES = ("test_strategies_e2e.py", "test_bench_quality.py", "test_launcher.py",
                      "test_scale_replicas.py", "test_zero_shot_refresh.py", "test_prepare.py",
                      "test_trainer_ranks.py", "test_api.py", "test_export.py",
                      "test_s3_corpus_e2e.py", "test_embedded_partitions.py",
                      "test_retention_e2e.py", "test_chaos.py", "test_restarts.py",
                      "test_run_resume.py")


def _module(nodeid: str) -> str:
    return Path(nodeid.split("::", 1)[0]).name


def work_unit(nodeid: str) -> str:
    """The unit of work (for pytest-xdist) that the test ``nodeid`` belongs to."""
    return WORK_UNITS.get(_module(nodeid), nodeid)


def pytest_configure(config: pytest.Config) -> None:
    use_worker_port_range()
    # Every process that runs tests (not xdist's controller) forks the trainers and
    # inferencers it starts, and those of the runs it launches, from one warm-start server
    # (dev/ance_train_dev/service_harness.py); its imports overlap the collection.
    if os.environ.get("PYTEST_XDIST_WORKER") or not config.getoption("numprocesses", None):
        start_warm_start_server()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("fault") and work_unit(item.nodeid) != "fault":
            raise pytest.UsageError(f"{item.nodeid} is a fault test: add its module to "
                                    "FAULT_MODULES in tests/conftest.py")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker orders alike: one collection
        items.sort(key=lambda item: _module(item.nodeid) not in SLOW_FIRST_MODULES)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnitScheduling(LoadScopeScheduling):
        """xdist's scope scheduling (largest units first, then one unit at a time to whichever
        worker runs dry) over the units of ``work_unit``."""

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnitScheduling(config, log)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server process for one test."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


REDIS_TEST_PASSWORD = "redis-pw-7c41e0b9"


@pytest.fixture
def redis_with_password(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server process that requires ``REDIS_TEST_PASSWORD`` (``requirepass``)."""
    server = RedisServer(tmp_path / "redis-auth", password=REDIS_TEST_PASSWORD).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def bus(redis_server: RedisServer) -> EventBus:
    return EventBus(connect(redis_server.url), "test-run")


@pytest.fixture(scope="session")
def s3_env() -> Iterator[dict[str, str]]:
    """A moto S3 server on loopback, shared by the session; yields the ANCE_S3_* variables."""
    with moto_server() as env:
        yield env


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wider than ``tiny_model``: its training steps outlast an index refresh of the subset,
    so the asynchronous swaps of a short run are observable."""
    return make_tiny_bert(tmp_path_factory.mktemp("small-bert"), hidden=128, layers=2)


@pytest.fixture(scope="session")
def scifact_subset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scifact_subset(tmp_path_factory.mktemp("scifact-subset"))
