"""Receives ``negatives.ready`` in the background and holds the newest tables for the loop.

It keeps the BM25 table, the newest ANN table and the newest DANCE negative-query table.
The training loop reads them once per batch: attribute reads, so switching to newer
negatives never blocks a step (ANCE §4, asynchronous index refresh).

A resumed trainer first reloads the tables it held at its checkpoint, then catches up with
every newer table announced in the stream: the process that died may already have
acknowledged those events, so the consumer group would not deliver them again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ance_train.infra import bus as events
from ance_train.infra.store import ObjectStore, StorageError
from ance_train.negatives.table import NegativesTable
from ance_train.protocol.refresh import negatives_key
from ance_train.trainer.training_state import NegativesInUse

log = logging.getLogger(__name__)


class NegativesFeed:
    GROUP = "trainer"

    def __init__(self, bus: events.EventBus, store: ObjectStore, instance: str,
                 stop: threading.Event) -> None:
        self.bus = bus
        self.store = store
        self.instance = instance
        self.stop = stop
        self.bm25: NegativesTable | None = None
        self.ann: NegativesTable | None = None
        self.dual: NegativesTable | None = None
        self._arrived = threading.Condition()
        self._thread = threading.Thread(target=self._listen, name="negatives-feed", daemon=True)

    def start(self) -> NegativesFeed:
        self._thread.start()
        return self

    def restore(self, held: NegativesInUse) -> None:
        """Reload the tables held at a checkpoint, then take any newer announced one."""
        wanted = {"bm25": negatives_key("bm25") if held.bm25 else None,
                  "ann": None if held.ann is None else negatives_key(held.ann),
                  "dual": None if held.dual is None else negatives_key(f"{held.dual}-dual")}
        for name, key in wanted.items():
            if key is None:
                continue
            try:
                self._set(name, self._load(key))
            except StorageError as error:
                log.error("cannot reload the %s negatives %s: %s", name, key, error)
        for event in self.bus.history(events.NEGATIVES_READY):
            self._handle(event)

    def wait_until(self, ready: Callable[[], bool], timeout_s: float | None = None) -> bool:
        """Block until ``ready()`` (only allowed before the first step)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._arrived:
            while not ready() and not self.stop.is_set():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._arrived.wait(timeout=min(1.0, remaining or 1.0))
        return ready()

    def _listen(self) -> None:
        while not self.stop.is_set():
            try:
                batch = self.bus.consume(events.NEGATIVES_READY, self.GROUP, self.instance,
                                         block_ms=500)
            except Exception as error:  # Redis restarting: back off, the group keeps our place
                log.warning("reading negatives.ready failed: %s", error)
                self.stop.wait(1.0)
                continue
            for event in batch:
                self._handle(event)
                self.bus.ack(events.NEGATIVES_READY, self.GROUP, event.entry_id)

    def _handle(self, event: events.Event) -> None:
        payload = event.payload
        try:
            if payload.get("source") == "bm25":
                if self.bm25 is None:
                    self._set("bm25", self._load(payload["key"]))
                return
            current = self.ann.step if self.ann is not None else None
            if payload.get("key") and (current is None or event.step > current):
                self._set("ann", self._load(payload["key"]))
            elif payload.get("key"):
                log.info("ignoring negatives of step %d (using %d)", event.step, current)
            if payload.get("dual_key") and (self.dual is None or event.step > self.dual.step):
                self._set("dual", self._load(payload["dual_key"]))
        except StorageError as error:
            log.error("cannot load negatives of step %d: %s", event.step, error)

    def _load(self, key: str) -> NegativesTable:
        return NegativesTable.from_bytes(self.store.get_bytes(key))

    def _set(self, name: str, table: NegativesTable) -> None:
        with self._arrived:
            setattr(self, name, table)  # one reference swap, read by the loop at its next batch
            self._arrived.notify_all()
        log.info("%s negatives of step %d ready (%d rows)", name, table.step, len(table))
