"""The trainer's thread count follows the refreshes of its checkpoints (real Redis streams).

``set_threads`` records instead of calling ``torch.set_num_threads``: the test is about
which count each step gets, and must not change the test process's own threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from ance_train.infra.bus import EventBus, connect
from ance_train.launcher.redis_server import RedisServer
from ance_train.protocol.events import EvalCompleted
from ance_train.trainer.core_sharing import PAGE, RefreshAwareThreads


@pytest.fixture
def stop() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()


def _evaluated(bus: EventBus, step: int) -> None:
    bus.publish(EvalCompleted(step=step, key=f"eval/{step}.json", metrics={}))


def _becomes(threads: RefreshAwareThreads, count: int, timeout_s: float = 10.0) -> bool:
    """The listener thread reads evaluations asynchronously: poll until it has."""
    deadline = time.monotonic() + timeout_s
    while threads.before_step() != count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_threads_drop_while_a_checkpoint_is_encoded_and_rise_once_it_is_evaluated(
        bus: EventBus, stop: threading.Event) -> None:
    calls: list[int] = []
    threads = RefreshAwareThreads(bus, 1, 2, calls.append, stop).start()
    threads.checkpoint_saved(0)
    assert threads.before_step() == 1, "checkpoint 0 is being encoded"
    assert threads.before_step() == 1 and calls == [1], "set once, not every step"
    _evaluated(bus, 0)
    assert _becomes(threads, 2)
    threads.checkpoint_saved(20)
    assert threads.before_step() == 1
    # An evaluation of a later checkpoint also ends the wait (20 was superseded by 40).
    threads.checkpoint_saved(40)
    _evaluated(bus, 40)
    assert _becomes(threads, 2)
    assert calls == [1, 2, 1, 2]


def test_a_restarted_trainer_reads_every_evaluation_so_far(bus: EventBus,
                                                           stop: threading.Event) -> None:
    last = (PAGE + 4) * 10
    for step in range(0, last + 10, 10):  # more than one page of the stream
        _evaluated(bus, step)
    threads = RefreshAwareThreads(bus, 1, 3, lambda n: None, stop)
    threads.checkpoint_saved(last)  # resumed on the last evaluated checkpoint
    assert threads.before_step() == 1, "nothing read yet"
    threads.start()
    assert _becomes(threads, 3)
    assert threads.evaluated == last


def test_a_step_never_waits_on_an_unreachable_redis(redis_server: RedisServer,
                                                    stop: threading.Event) -> None:
    bus = EventBus(connect(redis_server.url), "test-run")
    threads = RefreshAwareThreads(bus, 1, 2, lambda n: None, stop).start()
    threads.checkpoint_saved(0)
    _evaluated(bus, 0)
    assert _becomes(threads, 2)
    redis_server.stop()
    threads.checkpoint_saved(20)
    started = time.monotonic()
    assert threads.before_step() == 1, "no news of checkpoint 20: the safe side"
    assert time.monotonic() - started < 0.1
