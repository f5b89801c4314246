"""Events and the shard work queue on Redis Streams.

One stream per event type per run (``ance:<run>:<event>``). Consumers read through consumer
groups, so an entry is delivered to one consumer of a group and stays *pending* until it is
acknowledged: nothing is lost across restarts, and an entry held by a dead consumer can be
reclaimed (``XAUTOCLAIM``) by another one after ``claim_timeout_s`` of silence. Live
consumers keep their claim fresh with :meth:`WorkQueue.heartbeat`.

What travels is defined in :mod:`ance_train.protocol`: every entry is validated against the
model of its stream when it is read. An entry that does not validate is never handed to a
handler: it is logged, copied to the run's dead-letter stream (``ance:<run>:dead-letter``,
with the stream, entry id and error) and acknowledged, so a bad payload is neither retried
forever nor lost. Handlers must be idempotent, because redelivery can repeat an event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from ance_train.infra.credentials import REDIS_PASSWORD_VAR, redis_password
from ance_train.infra.tls import REDIS_USERNAME_VAR, redis_client_options
from ance_train.protocol import keys
from ance_train.protocol.events import Event
from ance_train.protocol.message import MalformedMessage, Message
from ance_train.protocol.supersession import worth_encoding
from ance_train.protocol.work import ShardWork

log = logging.getLogger(__name__)

# What a call raises once the client's own retries gave up (Redis down or restarting): a
# consumer loop backs off and goes on; whatever it had not acknowledged is delivered again.
# Consumer loops catch these and nothing else: any other error stops the service.
REDIS_UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError)
# How long an idle service's read of its streams blocks. A new entry ends the wait at once,
# so this bounds only how late an idle service notices a request to stop (a SIGTERM does not
# interrupt the read): a quarter of a second, against the second it was.
IDLE_BLOCK_MS = 250

# Stream entries as this package's clients return them. The casts to it (and to ``str``):
# every client is made by :func:`connect`, with ``decode_responses=True``, so replies are str
# where redis-py's hints say ``bytes | str`` (and a stream range is a list, never None).
_Entries = list[tuple[str, dict[str, str]]]

# Atomically raise the "refresh under way" marker; returns the marker after the update.
_RAISE_MAX = """
local current = tonumber(redis.call('GET', KEYS[1]) or '-1')
local proposed = tonumber(ARGV[1])
if proposed > current then redis.call('SET', KEYS[1], proposed); return proposed end
return current
"""

E = TypeVar("E", bound=Event)
M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class Received(Generic[E]):
    """One validated entry of a stream: its id (the Redis server's clock) and its event."""

    entry_id: str
    event: E

    @property
    def step(self) -> Any:
        return getattr(self.event, "step", None)


@dataclass(frozen=True)
class DeadLetter:
    """An entry that failed validation, as kept in the dead-letter stream."""

    entry_id: str  # in the dead-letter stream
    stream: str  # where it was published
    original_id: str
    error: str
    data: str


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
                    f"Redis refused authentication ({error}); check {REDIS_USERNAME_VAR} and "
                    f"{REDIS_PASSWORD_VAR}"
                ) from error

        return super().call_with_retry(attempt, fail, *args, **kwargs)


def connect(url: str, password: str | None = None) -> redis.Redis:
    """A client that retries broken connections (Redis restarts) with backoff.

    ``password`` (default: ``ANCE_REDIS_PASSWORD``) is the AUTH password, used unless the URL
    carries one; ``ANCE_REDIS_USERNAME`` the ACL user, and a ``rediss://`` URL TLS with
    ``ANCE_REDIS_TLS_*`` (:func:`ance_train.infra.tls.redis_client_options`).
    """
    return redis.Redis.from_url(
        url,
        password=password or redis_password(),
        **redis_client_options(url),
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
        self._raise_max: Any = None  # the registered _RAISE_MAX script, on first use
        self.client = client
        self.run_id = run_id

    def stream(self, event_type: type[Message] | str) -> str:
        name = event_type if isinstance(event_type, str) else event_type.TYPE
        return keys.redis_key(self.run_id, name)

    def key(self, name: str) -> str:
        """A plain key in the run's namespace (names in :mod:`ance_train.protocol.keys`)."""
        return keys.redis_key(self.run_id, name)

    def publish(self, event: Event) -> str:
        """Add ``event`` (stamped with this run's id) to its stream; returns the entry id."""
        stamped = event.model_copy(update={"run_id": self.run_id})
        return cast(str, self.client.xadd(self.stream(type(event)), {"data": stamped.encode()}))

    def ensure_group(self, event_type: type[Message], group: str, start: str = "0") -> None:
        """Create the consumer group (from the start of the stream) if it does not exist."""
        try:
            self.client.xgroup_create(self.stream(event_type), group, id=start, mkstream=True)
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise

    def consume(self, event_type: type[E], group: str, consumer: str, block_ms: int = 1000,
                count: int = 16) -> list[Received[E]]:
        """New entries for this group; first re-delivers this consumer's own pending ones.
        Entries that do not validate are dead-lettered and acknowledged, not returned."""
        self.ensure_group(event_type, group)
        stream = self.stream(event_type)
        pending = self.client.xreadgroup(group, consumer, {stream: "0"}, count=count)
        entries = _entries(pending)
        if not entries:
            fresh = self.client.xreadgroup(group, consumer, {stream: ">"}, count=count,
                                           block=_block(block_ms))
            entries = _entries(fresh)
        received = []
        for entry_id, fields in entries:
            try:
                received.append(Received(entry_id, self.decode(event_type, fields)))
            except MalformedMessage as error:
                self.dead_letter(stream, entry_id, fields, error)
                self.client.xack(stream, group, entry_id)
        return received

    def ack(self, event_type: type[Event], group: str, entry_id: str) -> None:
        self.client.xack(self.stream(event_type), group, entry_id)

    def read_all(self, event_type: type[E], after: str = "0", block_ms: int | None = None,
                 count: int = 100) -> list[Received[E]]:
        """Read without a group (observers such as the launcher and ``status``)."""
        reply = self.client.xread({self.stream(event_type): after}, count=count,
                                  block=_block(block_ms))
        return list(self._valid(event_type, _entries(reply)))

    def history(self, event_type: type[E]) -> Iterator[Received[E]]:
        """Every valid entry of the stream, oldest first (restart recovery, observers)."""
        yield from self._valid(event_type,
                               cast(_Entries, self.client.xrange(self.stream(event_type))))

    def last_entry_id(self, event_type: type[Event]) -> str:
        """The id of the newest entry of the stream (``0`` if empty): a cursor for
        :meth:`read_all` that skips the history."""
        newest = cast(_Entries, self.client.xrevrange(self.stream(event_type), count=1))
        return newest[0][0] if newest else "0"

    def _valid(self, event_type: type[E], entries: Iterable[tuple[str, dict]]
               ) -> Iterator[Received[E]]:
        """Validated entries; a malformed one was dead-lettered by the consumer group that
        first read it, so observers only log and skip it."""
        for entry_id, fields in entries:
            try:
                yield Received(entry_id, self.decode(event_type, fields))
            except MalformedMessage as error:
                log.warning("skipping malformed entry %s of %s: %s", entry_id,
                            self.stream(event_type), error)

    def decode(self, message_type: type[M], fields: dict) -> M:
        """The message of a stream entry of this run; :class:`MalformedMessage` otherwise."""
        if "data" not in fields:
            raise MalformedMessage(f"not a valid {message_type.TYPE} message: no data field")
        message = message_type.decode(fields["data"])
        if message.run_id != self.run_id:
            raise MalformedMessage(f"run_id {message.run_id!r} in the stream of run "
                                   f"{self.run_id!r}")
        return message

    # -- dead letters -----------------------------------------------------------------------
    def dead_letter(self, stream: str, entry_id: str, fields: dict, error: Exception) -> None:
        """Keep an entry that failed validation, with why, and log it once."""
        log.error("dead-lettered entry %s of %s: %s", entry_id, stream, error)
        self.client.xadd(self.key(keys.DEAD_LETTER_STREAM), {
            "stream": stream, "entry_id": entry_id, "error": str(error),
            "data": str(fields.get("data", fields))})

    def dead_letters(self) -> list[DeadLetter]:
        return [DeadLetter(entry_id, f["stream"], f["entry_id"], f["error"], f["data"])
                for entry_id, f in cast(_Entries,
                                        self.client.xrange(self.key(keys.DEAD_LETTER_STREAM)))]

    # Supersession (the rule: protocol/supersession.py): the latest published checkpoint,
    # which the trainer sets, and the refresh under way, which inferencers raise.
    def set_latest_checkpoint(self, step: int) -> None:
        self.client.set(self.key(keys.LATEST_CHECKPOINT), int(step))

    def latest_checkpoint(self) -> int:
        value = self.client.get(self.key(keys.LATEST_CHECKPOINT))
        return -1 if value is None else int(value)

    def refresh_under_way(self) -> int:
        """The highest checkpoint step any inferencer started encoding (-1: none yet)."""
        value = self.client.get(self.key(keys.REFRESH_UNDER_WAY))
        return -1 if value is None else int(value)

    def start_encoding(self, step: int) -> bool:
        """Whether an item of checkpoint ``step`` is worth encoding now
        (:func:`~ance_train.protocol.supersession.worth_encoding`); if it is, the refresh
        under way is raised to ``step`` (atomically: never lowered by a slower replica)."""
        if not worth_encoding(step, self.latest_checkpoint(), self.refresh_under_way()):
            return False
        if self._raise_max is None:
            self._raise_max = self.client.register_script(_RAISE_MAX)
        self._raise_max(keys=[self.key(keys.REFRESH_UNDER_WAY)], args=[int(step)])
        return True

    # Service registry for `ance-train status`: role/instance -> gRPC address, with a TTL.
    def register(self, role: str, instance: str, address: str, ttl_s: int = 30) -> None:
        self.client.set(self.key(keys.service_registration(role, instance)), address, ex=ttl_s)

    def services(self) -> dict[str, str]:
        prefix = self.key(keys.service_registration("", ""))[: -len(":")]
        found = {}
        for key in self.client.scan_iter(match=prefix + "*"):
            address = self.client.get(key)
            if address:
                found[key[len(prefix):]] = address
        return dict(sorted(found.items()))


class WorkItem(ShardWork):
    """A claimed :class:`ShardWork`: the work plus its entry id and which delivery this is."""

    entry_id: str
    attempt: int = 1


class WorkQueue:
    """The shard work queue: a stream with one consumer group shared by all inferencers."""

    GROUP = "inferencers"

    def __init__(self, bus: EventBus, claim_timeout_s: float) -> None:
        self.bus = bus
        self.claim_timeout_ms = int(claim_timeout_s * 1000)
        self.stream = bus.stream(ShardWork)

    def enqueue(self, items: Iterable[ShardWork]) -> None:
        """Queue the items in one transaction."""
        pipe = self.bus.client.pipeline(transaction=True)
        for work in items:
            stamped = work.model_copy(update={"run_id": self.bus.run_id})
            pipe.xadd(self.stream, {"data": stamped.encode()})
        pipe.execute()

    def claim(self, consumer: str, block_ms: int = 1000) -> WorkItem | None:
        """Take one item: a timed-out item of a dead replica first, else a new one.
        A malformed item is dead-lettered and acknowledged, and the next one is taken."""
        while True:
            claimed = self._claim_entry(consumer, block_ms)
            if claimed is None:
                return None
            entry_id, fields, attempt = claimed
            try:
                work = self.bus.decode(ShardWork, fields)
                return WorkItem(**work.model_dump(), entry_id=entry_id, attempt=attempt)
            except MalformedMessage as error:
                self.bus.dead_letter(self.stream, entry_id, fields, error)
                self.bus.client.xack(self.stream, self.GROUP, entry_id)

    def _claim_entry(self, consumer: str, block_ms: int) -> tuple[str, dict, int] | None:
        self.bus.ensure_group(ShardWork, self.GROUP)
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
                    return entry_id, fields, self._deliveries(entry_id)
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
        return entry_id, fields, 1

    def heartbeat(self, consumer: str, item: WorkItem) -> None:
        """Reset the idle time of an item this replica is still working on."""
        self.bus.client.xclaim(self.stream, self.GROUP, consumer, min_idle_time=0,
                               message_ids=[item.entry_id], justid=True)

    def done(self, item: WorkItem) -> None:
        self.bus.client.xack(self.stream, self.GROUP, item.entry_id)

    def pending_count(self) -> int:
        self.bus.ensure_group(ShardWork, self.GROUP)
        return int(self.bus.client.xpending(self.stream, self.GROUP)["pending"])

    def _deliveries(self, entry_id: str) -> int:
        info = self.bus.client.xpending_range(self.stream, self.GROUP, min=entry_id, max=entry_id,
                                              count=1)
        return int(info[0]["times_delivered"]) if info else 1


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
