"""Fixtures that start real servers: Redis (redis-server process) and S3 (moto server)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ance_train.infra.bus import EventBus, connect
from ance_train.launcher.redis_server import RedisServer

from helpers import make_scifact_subset, make_tiny_bert
from servers import moto_server


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
