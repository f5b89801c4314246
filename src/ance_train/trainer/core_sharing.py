"""How many CPU threads the trainer computes with, when it shares a machine's cores with the
inferencers (embedded mode).

The inferencers encode a checkpoint for only part of each refresh interval. While they do, the
trainer keeps to ``training.torch_threads``: more busy threads than cores slows every process
down. Between refreshes their cores are idle, and the trainer takes
``training.torch_threads_between_refreshes``. The refresh of checkpoint N is under way from
the moment the trainer saves N until the indexer announces ``eval.completed`` for N or a
later checkpoint: by then every shard of N has been encoded. A checkpoint that is never
evaluated (abandoned) keeps the trainer at the lower count until a later one is: the safe side.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ance_train.infra.bus import REDIS_UNAVAILABLE, EventBus
from ance_train.protocol.events import EvalCompleted

log = logging.getLogger(__name__)
PAGE = 100  # evaluations read per Redis call


class RefreshAwareThreads:
    """Sets the thread count before each step: ``during`` while one of this trainer's
    checkpoints awaits its evaluation, ``between`` otherwise. The evaluations are read on a
    thread of their own, so a step never waits on Redis (unreachable, nothing new arrives:
    the next checkpoint keeps the trainer at ``during``)."""

    def __init__(self, bus: EventBus, during: int, between: int,
                 set_threads: Callable[[int], None], stop: threading.Event) -> None:
        self.bus = bus
        self.during, self.between = during, between
        self.set_threads = set_threads
        self.stop = stop
        self.saved = -1      # the newest checkpoint this trainer saved
        self.evaluated = -1  # the newest checkpoint the indexer evaluated (listener thread)
        self.current: int | None = None
        self._thread = threading.Thread(target=self._listen, name="refresh-threads",
                                        daemon=True)

    def start(self) -> RefreshAwareThreads:
        self._thread.start()
        return self

    def checkpoint_saved(self, step: int) -> None:
        self.saved = max(self.saved, step)

    def before_step(self) -> int:
        """Set and return the thread count of the step about to run."""
        wanted = self.during if self.saved > self.evaluated else self.between
        if wanted != self.current:
            self.set_threads(wanted)
            self.current = wanted
        return wanted

    def _listen(self) -> None:
        cursor = "0"  # every evaluation so far: a restarted trainer's included
        while not self.stop.is_set():
            try:
                arrived = self.bus.read_all(EvalCompleted, after=cursor, block_ms=1000,
                                            count=PAGE)
            except REDIS_UNAVAILABLE as error:
                log.warning("reading eval.completed failed: %s", error)
                self.stop.wait(1.0)
                continue
            for received in arrived:
                cursor = received.entry_id
                self.evaluated = max(self.evaluated, received.event.step)
