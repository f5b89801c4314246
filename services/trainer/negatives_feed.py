"""Receives ``negatives.ready`` in the background and hands the newest table to the loop.

The training loop calls :meth:`NegativesFeed.current` once per batch: an attribute read, so
switching to newer negatives never blocks a step (ANCE §4, asynchronous index refresh).
"""

from __future__ import annotations

import logging
import threading
import time

from ance_train.common import events
from ance_train.common.negatives import NegativesTable
from ance_train.common.storage import ObjectStore, StorageError

log = logging.getLogger(__name__)


class NegativesFeed:
    GROUP = "trainer"

    def __init__(self, bus: events.EventBus, store: ObjectStore, instance: str,
                 stop: threading.Event) -> None:
        self.bus = bus
        self.store = store
        self.instance = instance
        self.stop = stop
        self._latest: NegativesTable | None = None
        self._arrived = threading.Condition()
        self._thread = threading.Thread(target=self._listen, name="negatives-feed", daemon=True)

    def start(self) -> NegativesFeed:
        self._thread.start()
        return self

    def current(self) -> NegativesTable | None:
        return self._latest

    def wait_first(self, timeout_s: float | None = None) -> NegativesTable | None:
        """Block until some negatives exist (only allowed before the first step)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._arrived:
            while self._latest is None and not self.stop.is_set():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._arrived.wait(timeout=min(1.0, remaining or 1.0))
        return self._latest

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
        current = self._latest
        if current is not None and event.step <= current.step:
            log.info("ignoring negatives of step %d (using %d)", event.step, current.step)
            return
        try:
            table = NegativesTable.from_bytes(self.store.get_bytes(event.payload["key"]))
        except StorageError as error:
            log.error("cannot load negatives of step %d: %s", event.step, error)
            return
        with self._arrived:
            self._latest = table
            self._arrived.notify_all()
        log.info("negatives of step %d ready (%d queries)", table.step, len(table))
