"""Events and the shard work queue on Redis Streams.

One stream per event type per run (``ance:<run>:<event>``). Consumers read through consumer
groups, so an entry is delivered to one consumer of a group and stays *pending* until it is
acknowledged: nothing is lost across restarts, and an entry held by a dead consumer can be
reclaimed (``XAUTOCLAIM``) by another one after ``claim_timeout_s`` of silence. Live
consumers keep their claim fresh with :meth:`WorkQueue.heartbeat`.

Every event carries ``run_id`` and ``step`` (the checkpoint step it belongs to); handlers
must be idempotent, because redelivery can repeat an event.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from ance_train.infra.credentials import REDIS_PASSWORD_VAR, redis_password

log = logging.getLogger(__name__)

CHECKPOINT_PUBLISHED = "checkpoint.published"
SHARD_ENCODED = "shard.encoded"
# An item given up on: its checkpoint cannot be read (corrupt or missing) after
# inference.max_attempts deliveries. The checkpoint is abandoned; later ones go on.
SHARD_FAILED = "shard.failed"
NEGATIVES_READY = "negatives.ready"
EVAL_COMPLETED = "eval.completed"
WORK_QUEUE = "work"
RUN_FINISHED = "run.finished"

# What a call raises once the client's own retries gave up (Redis down or restarting): a
# consumer loop backs off and goes on; whatever it had not acknowledged is delivered again.
REDIS_UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError)


@dataclass(frozen=True)
class Event:
    """One entry of a stream: its id, type and payload (always with ``run_id`` and ``step``)."""

    entry_id: str
    type: str
    payload: dict[str, Any] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return int(self.payload["step"])


class RedisAuthError(redis.RedisError):
    """Redis refused the credentials (not a ConnectionError: retrying will not help)."""


class _Retry(Retry):
    """Retries broken connections with backoff, but never a refused password."""

    def call_with_retry(self, do: Callable[[], Any], fail: Callable[..., Any], *args: Any,
                        **kwargs: Any) -> Any:
        def attempt() -> Any:
            try:
                return do()
            except redis.AuthenticationError as error:
                raise RedisAuthError(
                    f"Redis refused authentication ({error}); check {REDIS_PASSWORD_VAR}"
                ) from error

        return super().call_with_retry(attempt, fail, *args, **kwargs)


def connect(url: str, password: str | None = None) -> redis.Redis:
    """A client that retries broken connections (Redis restarts) with backoff.

    ``password`` (default: ``ANCE_REDIS_PASSWORD``) is the AUTH password, used unless the URL
    carries one.
    """
    return redis.Redis.from_url(
        url,
        password=password or redis_password(),
        decode_responses=True,
        retry=_Retry(ExponentialBackoff(cap=5.0, base=0.1), retries=20),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=15,
        socket_timeout=30,
        socket_connect_timeout=5,
    )


class EventBus:
    """Publish and consume the events of one run."""

    def __init__(self, client: redis.Redis, run_id: str) -> None:
        self.client = client
        self.run_id = run_id

    def stream(self, event_type: str) -> str:
        return f"ance:{self.run_id}:{event_type}"

    def key(self, name: str) -> str:
        """A plain key in the run's namespace (registry, latest checkpoint, ...)."""
        return f"ance:{self.run_id}:{name}"

    def publish(self, event_type: str, step: int, **payload: Any) -> str:
        body = {"run_id": self.run_id, "step": int(step), **payload}
        return self.client.xadd(self.stream(event_type), {"data": json.dumps(body)})

    def ensure_group(self, event_type: str, group: str, start: str = "0") -> None:
        """Create the consumer group (from the start of the stream) if it does not exist."""
        try:
            self.client.xgroup_create(self.stream(event_type), group, id=start, mkstream=True)
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise

    def consume(
        self, event_type: str, group: str, consumer: str, block_ms: int = 1000, count: int = 16
    ) -> list[Event]:
        """New entries for this group; first re-delivers this consumer's own pending ones."""
        self.ensure_group(event_type, group)
        stream = self.stream(event_type)
        pending = self.client.xreadgroup(group, consumer, {stream: "0"}, count=count)
        entries = _entries(pending)
        if not entries:
            fresh = self.client.xreadgroup(group, consumer, {stream: ">"}, count=count,
                                           block=_block(block_ms))
            entries = _entries(fresh)
        return [_to_event(event_type, entry_id, fields) for entry_id, fields in entries]

    def ack(self, event_type: str, group: str, entry_id: str) -> None:
        self.client.xack(self.stream(event_type), group, entry_id)

    def read_all(self, event_type: str, after: str = "0", block_ms: int | None = None,
                 count: int = 100) -> list[Event]:
        """Read without a group (observers such as the launcher and ``status``)."""
        reply = self.client.xread({self.stream(event_type): after}, count=count,
                                  block=_block(block_ms))
        return [_to_event(event_type, entry_id, fields) for entry_id, fields in _entries(reply)]

    def history(self, event_type: str) -> Iterator[Event]:
        for entry_id, fields in self.client.xrange(self.stream(event_type)):
            yield _to_event(event_type, entry_id, fields)

    # Latest published checkpoint: lets stale work be skipped cheaply.
    def set_latest_checkpoint(self, step: int) -> None:
        self.client.set(self.key("latest_checkpoint"), int(step))

    def latest_checkpoint(self) -> int:
        value = self.client.get(self.key("latest_checkpoint"))
        return -1 if value is None else int(value)

    # Service registry for `ance-train status`: role/instance -> gRPC address, with a TTL.
    def register(self, role: str, instance: str, address: str, ttl_s: int = 30) -> None:
        self.client.set(self.key(f"service:{role}:{instance}"), address, ex=ttl_s)

    def services(self) -> dict[str, str]:
        prefix = self.key("service:")
        found = {}
        for key in self.client.scan_iter(match=prefix + "*"):
            address = self.client.get(key)
            if address:
                found[key[len(prefix):]] = address
        return dict(sorted(found.items()))


@dataclass(frozen=True)
class WorkItem:
    """A shard to encode with one checkpoint: ``kind`` is ``corpus`` or ``queries``."""

    entry_id: str
    step: int
    kind: str
    shard: int
    start: int
    stop: int
    attempt: int = 1

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.shard:05d}"


class WorkQueue:
    """The shard work queue: a stream with one consumer group shared by all inferencers."""

    GROUP = "inferencers"

    def __init__(self, bus: EventBus, claim_timeout_s: float) -> None:
        self.bus = bus
        self.claim_timeout_ms = int(claim_timeout_s * 1000)
        self.stream = bus.stream(WORK_QUEUE)

    def enqueue(self, step: int, kind: str, ranges: list[tuple[int, int]],
                first_shard: int = 0) -> None:
        """Queue one item per range, numbered from ``first_shard`` (to re-queue one shard)."""
        pipe = self.bus.client.pipeline(transaction=True)
        for shard, (start, stop) in enumerate(ranges, start=first_shard):
            body = {"run_id": self.bus.run_id, "step": step, "kind": kind, "shard": shard,
                    "start": start, "stop": stop}
            pipe.xadd(self.stream, {"data": json.dumps(body)})
        pipe.execute()

    def claim(self, consumer: str, block_ms: int = 1000) -> WorkItem | None:
        """Take one item: a timed-out item of a dead replica first, else a new one."""
        self.bus.ensure_group(WORK_QUEUE, self.GROUP)
        client = self.bus.client
        # XAUTOCLAIM scans a bounded number of pending entries per call: follow its cursor
        # through the whole pending list so an item behind many live ones is still found.
        cursor = "0-0"
        while True:
            next_cursor, entries, *_ = client.xautoclaim(
                self.stream, self.GROUP, consumer, min_idle_time=self.claim_timeout_ms,
                start_id=cursor, count=1)
            for entry_id, fields in entries:
                if fields:  # a deleted entry comes back without fields
                    return self._item(entry_id, fields, attempt=self._deliveries(entry_id))
                client.xack(self.stream, self.GROUP, entry_id)
            if next_cursor in ("0-0", b"0-0"):
                break
            cursor = next_cursor
        reply = client.xreadgroup(self.GROUP, consumer, {self.stream: ">"}, count=1,
                                  block=_block(block_ms))
        fresh = _entries(reply)
        if not fresh:
            return None
        entry_id, fields = fresh[0]
        return self._item(entry_id, fields, attempt=1)

    def heartbeat(self, consumer: str, item: WorkItem) -> None:
        """Reset the idle time of an item this replica is still working on."""
        self.bus.client.xclaim(self.stream, self.GROUP, consumer, min_idle_time=0,
                               message_ids=[item.entry_id], justid=True)

    def done(self, item: WorkItem) -> None:
        self.bus.client.xack(self.stream, self.GROUP, item.entry_id)

    def pending_count(self) -> int:
        self.bus.ensure_group(WORK_QUEUE, self.GROUP)
        return int(self.bus.client.xpending(self.stream, self.GROUP)["pending"])

    def _deliveries(self, entry_id: str) -> int:
        info = self.bus.client.xpending_range(self.stream, self.GROUP, min=entry_id, max=entry_id,
                                              count=1)
        return int(info[0]["times_delivered"]) if info else 1

    @staticmethod
    def _item(entry_id: str, fields: dict, attempt: int) -> WorkItem:
        body = json.loads(fields["data"])
        return WorkItem(entry_id, int(body["step"]), body["kind"], int(body["shard"]),
                        int(body["start"]), int(body["stop"]), attempt)


def entry_seconds(entry_id: str) -> float:
    """When a stream entry was added (Redis server clock): the milliseconds part of its id."""
    return int(str(entry_id).split("-", 1)[0]) / 1000.0


def wait_for_redis(client: redis.Redis, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _block(block_ms: int | None) -> int | None:
    """Redis reads ``BLOCK 0`` as "wait forever"; we mean "do not wait"."""
    return block_ms if block_ms else None


def _entries(reply: Any) -> list[tuple[str, dict]]:
    if not reply:
        return []
    if isinstance(reply, dict):  # RESP3 shape
        return [entry for entries in reply.values() for entry in entries[0]]
    return [entry for _, entries in reply for entry in entries]


def _to_event(event_type: str, entry_id: str, fields: dict) -> Event:
    return Event(entry_id, event_type, json.loads(fields["data"]))
