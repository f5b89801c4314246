"""Receives ``negatives.ready`` in the background and holds the newest tables for the loop.

It keeps the BM25 table, the newest ANN table and the newest DANCE negative-query table.
The training loop reads them once per batch: attribute reads, so switching to newer
negatives never blocks a step (ANCE §4, asynchronous index refresh).

A resumed trainer first reloads the tables it held at its checkpoint, then catches up with
every newer table announced in the stream: the process that died may already have
acknowledged those events, so the consumer group would not deliver them again.

With a cache directory (the trainer's work directory) a table is downloaded to a local file
and memory-mapped (:meth:`NegativesTable.open`): the trainer never holds a large table in
memory as a whole, only the rows its batches draw. The file of a table replaced by a newer
one is deleted (its mapping stays valid until the old table is dropped).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ance_train.infra.bus import REDIS_UNAVAILABLE, EventBus
from ance_train.infra.store import ObjectStore, StorageError
from ance_train.negatives.table import NegativesTable
from ance_train.protocol.events import NegativesReady, TablesInUse
from ance_train.protocol.tables import TableId, TableKind
from ance_train.trainer.training_state import NegativesInUse

log = logging.getLogger(__name__)


class NegativesFeed:
    GROUP = "trainer"

    def __init__(self, bus: EventBus, store: ObjectStore, instance: str,
                 stop: threading.Event, on_swap: Callable[[], None] = lambda: None,
                 cache_dir: Path | None = None) -> None:
        self.bus = bus
        self.on_swap = on_swap  # after a table is swapped in (announces negatives.in_use)
        self.store = store
        self.cache_dir = cache_dir  # None: tables are read into memory
        self._files: dict[TableKind, Path] = {}  # the local file of each table held
        if cache_dir is not None:  # copies a previous process left: downloaded again if held
            for stale in (cache_dir / Path(TableId.bm25().key).parent).glob("*.npz"):
                stale.unlink(missing_ok=True)
        self.instance = instance
        self.stop = stop
        self.bm25: NegativesTable | None = None
        self.ann: NegativesTable | None = None
        self.dual: NegativesTable | None = None
        self.error: BaseException | None = None  # what stopped the feed thread, if anything
        # The refresh timeline's last rows: refresh step -> Unix times its negatives.ready was
        # read (``received_at``) and its tables were downloaded and swapped in (``held_at``).
        self.swap_times: dict[int, dict[str, float]] = {}
        self._arrived = threading.Condition()
        self._thread = threading.Thread(target=self._listen, name="negatives-feed", daemon=True)

    def start(self) -> NegativesFeed:
        self._thread.start()
        return self

    def restore(self, held: NegativesInUse) -> None:
        """Reload the tables held at a checkpoint, then take any newer announced one."""
        wanted = [TableId.bm25() if held.bm25 else None,
                  None if held.ann is None else TableId.ann(held.ann),
                  None if held.dual is None else TableId.dual(held.dual)]
        for table in wanted:
            if table is None:
                continue
            try:
                self._set(table, self._load(table))
            except StorageError as error:
                log.error("cannot reload the %s negatives %s: %s", table.kind, table.key, error)
        for received in self.bus.history(NegativesReady):
            self._handle(received.event)

    def check(self) -> None:
        """Re-raise, in the training loop, what stopped the feed thread (a bug, not Redis)."""
        if self.error is not None:
            raise RuntimeError("the negatives feed stopped") from self.error

    def wait_until(self, ready: Callable[[], bool], timeout_s: float | None = None) -> bool:
        """Block until ``ready()`` (only allowed before the first step)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._arrived:
            while not ready() and not self.stop.is_set() and self.error is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._arrived.wait(timeout=min(1.0, remaining or 1.0))
        return ready()

    def _listen(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    batch = self.bus.consume(NegativesReady, self.GROUP, self.instance,
                                             block_ms=500)
                except REDIS_UNAVAILABLE as error:  # back off; the group keeps our place
                    log.warning("reading negatives.ready failed: %s", error)
                    self.stop.wait(1.0)
                    continue
                for received in batch:
                    self._handle(received.event)
                    self.bus.ack(NegativesReady, self.GROUP, received.entry_id)
        except BaseException as error:  # a bug: the loop re-raises it (``check``)
            log.exception("the negatives feed stopped")
            with self._arrived:
                self.error = error
                self._arrived.notify_all()

    def _handle(self, event: NegativesReady) -> None:
        received = time.time()
        for table in event.tables:
            held = getattr(self, table.kind.value)
            if table.kind is TableKind.BM25:
                newer = held is None
            else:
                newer = held is None or (table.step or 0) > held.step
            if not newer:
                log.info("ignoring %s negatives %s (holding step %s)", table.kind, table,
                         held.step)
                continue
            try:
                loaded = self._load(table)
            except StorageError as error:
                log.error("cannot load negatives %s: %s", table.key, error)
                continue
            if table.step is not None and table.kind is not TableKind.BM25:
                # Before the swap: the loop may build its next batch on it at once.
                self.swap_times[table.step] = {"received_at": received, "held_at": time.time()}
            self._set(table, loaded)

    def _path(self, table: TableId) -> Path | None:
        """The local file of ``table`` (its object key under the cache directory)."""
        return None if self.cache_dir is None else self.cache_dir / table.key

    def _load(self, table: TableId) -> NegativesTable:
        path = self._path(table)
        if path is None:
            return NegativesTable.from_bytes(self.store.get_bytes(table.key))
        path.parent.mkdir(parents=True, exist_ok=True)
        self.store.get_file(table.key, path)  # checksum verified before the file appears
        try:
            return NegativesTable.open(path)
        except ValueError as error:  # verified yet unreadable: a writer's bug, not an outage
            raise StorageError(str(error)) from error

    def _set(self, table_id: TableId, table: NegativesTable) -> None:
        kind = table_id.kind
        with self._arrived:
            setattr(self, kind.value, table)  # one swap, read by the loop at its next batch
            self._arrived.notify_all()
        path, replaced = self._path(table_id), self._files.get(kind)
        if path is not None:
            self._files[kind] = path
            if replaced is not None and replaced != path:
                replaced.unlink(missing_ok=True)  # mapped pages stay readable until dropped
        log.info("%s negatives of step %d ready (%d rows)", kind, table.step, len(table))
        self.on_swap()

    def held(self) -> tuple[TableId, ...]:
        """The refresh tables (ANN, DANCE) held now: what the loop samples from."""
        return tuple(TableId(kind=kind, step=table.step) for kind, table in
                     ((TableKind.ANN, self.ann), (TableKind.DUAL, self.dual))
                     if table is not None)


class TablesAnnouncer:
    """Announces ``negatives.in_use``: the lowest refresh whose tables the trainer may still
    read from the store (:mod:`ance_train.infra.retention` deletes only below it).

    The trainer reads a refresh table from the store when the feed loads a newer one and when
    a restarted trainer reloads the tables of its newest complete checkpoint. So the floor is
    the minimum of the tables the feed holds and those held by the newest complete checkpoint
    and by any checkpoint still uploading (which becomes the newest complete one). A trainer
    whose strategies read refresh tables and that holds none yet needs every refresh (0).
    Called from the feed thread, the loop and the publisher thread; publishes only changes.
    """

    def __init__(self, bus: EventBus, feed: NegativesFeed, reads_refresh_tables: bool,
                 step: Callable[[], int]) -> None:
        self.bus = bus
        self.feed = feed
        self.reads_refresh_tables = reads_refresh_tables
        self.step = step
        self._checkpoints: dict[int, int | None] = {}  # step → lowest refresh table it holds
        self._lock = threading.Lock()
        self._last: tuple | None = None

    def checkpoint_saved(self, step: int, held: tuple[int | None, ...]) -> None:
        """A checkpoint holding tables of refreshes ``held`` is saved (not yet complete)."""
        steps = [s for s in held if s is not None]
        with self._lock:
            self._checkpoints[step] = min(steps) if steps else None
        self.announce()

    def checkpoint_complete(self, step: int) -> None:
        """Checkpoint ``step`` is in the store: older ones are no longer resumed from."""
        with self._lock:
            for older in [s for s in self._checkpoints if s < step]:
                del self._checkpoints[older]
        self.announce()

    def announce(self) -> None:
        """Publish the floor if it changed. Redis down: logged, and the next call retries
        (a stale floor is only lower, so nothing is deleted too early)."""
        with self._lock:
            tables = self.feed.held()
            needed = self._needed_from(tables)
            if self._last == (tables, needed):
                return
            try:
                self.bus.publish(TablesInUse(step=self.step(), tables=tables,
                                             needed_from=needed))
            except REDIS_UNAVAILABLE as error:
                log.warning("announcing negatives.in_use failed (retried later): %s", error)
                return
            self._last = (tables, needed)
        log.info("negatives in use %s; refreshes from %s may still be read",
                 [str(t) for t in tables] or "none", needed)

    def _needed_from(self, tables: tuple[TableId, ...]) -> int | None:
        held = [v for v in self._checkpoints.values() if v is not None]
        held += [t.step for t in tables if t.step is not None]
        if held:
            return min(held)
        return 0 if self.reads_refresh_tables else None
