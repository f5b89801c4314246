"""Prometheus metrics of the services (prometheus-client), served over HTTP on
``ANCE_METRICS_PORT`` (unset or 0: off).

The metrics are module-level objects the services update directly; each process exports only
those of its own role (plus the client's process metrics), so a trainer never shows an
inferencer's zeros.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)

METRICS_PORT_VAR = "ANCE_METRICS_PORT"

TRAINER_STEP = Gauge("ance_trainer_step", "Last completed training step.", registry=None)
TRAINER_LOSS = Gauge("ance_trainer_loss", "Training loss of the last step.", registry=None)
TRAINER_ASYNC_GAP = Gauge(
    "ance_trainer_async_gap_steps",
    "Current step minus the checkpoint step of the negatives in use.", registry=None)
TRAINER_NEGATIVES_STEP = Gauge(
    "ance_trainer_negatives_step",
    "Checkpoint step of the negatives the trainer uses (-1: BM25/random).", registry=None)
CHECKPOINTS_PUBLISHED = Counter(
    "ance_checkpoints_published_total", "Checkpoints uploaded and announced.", registry=None)

REFRESH_LATENCY = Histogram(
    "ance_refresh_latency_seconds",
    "Refresh period: checkpoint published → its negatives ready (Redis server clock).",
    buckets=(5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, float("inf")),
    registry=None)
INDEX_STEP = Gauge("ance_index_step", "Checkpoint step of the newest built index.",
                   registry=None)
EVAL_METRIC = Gauge("ance_eval_metric", "Evaluation of the newest index.",
                    ["split", "measure"], registry=None)

SHARDS_ENCODED = Counter(
    "ance_inferencer_shards_encoded_total", "Shards encoded and uploaded.", registry=None)
DOCS_ENCODED = Counter(
    "ance_inferencer_docs_encoded_total",
    "Texts encoded (corpus documents and queries).", registry=None)
DOCS_PER_SECOND = Gauge(
    "ance_inferencer_docs_per_second", "Encoding throughput of the last shard.", registry=None)

ROLE_METRICS = {
    "trainer": (TRAINER_STEP, TRAINER_LOSS, TRAINER_ASYNC_GAP, TRAINER_NEGATIVES_STEP,
                CHECKPOINTS_PUBLISHED),
    "indexer": (REFRESH_LATENCY, INDEX_STEP, EVAL_METRIC),
    "inferencer": (SHARDS_ENCODED, DOCS_ENCODED, DOCS_PER_SECOND),
}


class MetricsConfigError(ValueError):
    pass


def metrics_port(env: Mapping[str, str] = os.environ) -> int:
    """``ANCE_METRICS_PORT`` as a port number; 0 when unset (metrics off)."""
    raw = env.get(METRICS_PORT_VAR, "").strip()
    try:
        port = int(raw) if raw else 0
    except ValueError:
        raise MetricsConfigError(f"{METRICS_PORT_VAR} must be a port number, got {raw!r}") from None
    if not 0 <= port <= 65535:
        raise MetricsConfigError(f"{METRICS_PORT_VAR} must be in 0..65535, got {port}")
    return port


def start_metrics_server(role: str, port: int, host: str = "0.0.0.0") -> CollectorRegistry:
    """Serve ``/metrics`` with this role's metrics on ``host:port`` (a daemon thread)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    for metric in ROLE_METRICS[role]:
        registry.register(metric)
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as error:
        raise MetricsConfigError(
            f"cannot serve metrics on {METRICS_PORT_VAR}={port}: {error}") from None
    return registry
