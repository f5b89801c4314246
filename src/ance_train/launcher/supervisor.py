"""Restarting crashed service processes in the embedded mode, as the kubelet restarts a pod.

A :class:`Supervisor` thread polls every supervised process (the services and the run's
Redis). One that exited is started again, keeping its name, port and work directory, after
the back-off of ``services.restart`` (:class:`~ance_train.config.RestartConfig`: doubling
with each consecutive crash, forgotten once a process has run ``reset_after_s``). A service
that crashes more than ``max_restarts`` times within ``window_s`` (or at all, with policy
``never``) ends the run: :meth:`Supervisor.check` raises :class:`CrashLoop` naming it with its
last log lines. Every restart is recorded (:class:`Restart`) for the run's summary.

It runs on its own thread, not in the monitor's loop, because that loop reads Redis: with
Redis down its client blocks in its own retries, and Redis is one of the processes to restart.
That thread must outlive what it started: the children die with their parent
(``PR_SET_PDEATHSIG``, infra/process.py), and for the kernel the parent is the *thread* that
forked them. So :meth:`Supervisor.pause` ends the restarts when a run is torn down and
:meth:`Supervisor.close` ends the thread only after every child has been stopped.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from ance_train.config import RestartConfig

log = logging.getLogger(__name__)


class Supervised(Protocol):
    """A process the supervisor keeps running."""

    name: str

    def returncode(self) -> int | None:
        """None while it runs; its exit status (negative: killed by that signal) after."""

    def done(self, code: int) -> bool:
        """Whether exiting with ``code`` means it finished (no restart)."""

    def restart(self) -> None:
        """Start it again, with the same name, port and directories."""

    def log_tail(self) -> str:
        ...


class CrashLoop(RuntimeError):
    """A service exhausted its restart budget (or crashed under policy ``never``)."""


@dataclass
class Restart:
    """One crash of a supervised process and its restart."""

    service: str
    exit_code: int | None  # None: killed by a signal
    signal: str | None
    exited_at: str  # UTC, ISO 8601: when the supervisor saw it dead
    backoff_s: float
    restarted_after_s: float | None = None  # from seeing it dead to starting it again

    def to_dict(self) -> dict:
        return asdict(self)


def describe_exit(code: int) -> tuple[int | None, str | None]:
    """(exit code, signal name) of a Popen return code (negative: the signal that killed it)."""
    if code < 0:
        try:
            return None, signal.Signals(-code).name
        except ValueError:
            return None, f"signal {-code}"
    return code, None


@dataclass
class _State:
    started_at: float
    consecutive: int = 0
    crashes: deque[float] = field(default_factory=deque)
    due: float | None = None  # when a crashed process starts again
    pending: Restart | None = None


class Supervisor:
    """Keeps the registered processes running (see the module docstring)."""

    def __init__(self, config: RestartConfig, interval_s: float = 0.2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.interval_s = interval_s
        self.clock = clock
        self.restarts: list[Restart] = []
        self._services: dict[str, Supervised] = {}
        self._states: dict[str, _State] = {}
        self._failure: CrashLoop | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()  # no more restarts
        self._closing = threading.Event()  # the thread ends
        self._thread: threading.Thread | None = None

    def add(self, service: Supervised) -> None:
        with self._lock:
            self._services[service.name] = service
            self._states[service.name] = _State(started_at=self.clock())

    def start(self) -> Supervisor:
        self._thread = threading.Thread(target=self._loop, name="supervisor", daemon=True)
        self._thread.start()
        return self

    def pause(self) -> None:
        """No restart after this returns (the run is being torn down)."""
        with self._lock:  # a restart in flight has finished
            self._stopping.set()

    def close(self) -> None:
        """End the thread, once the processes it started have been stopped (see above)."""
        self.pause()
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def check(self) -> None:
        """Raise the :class:`CrashLoop` that ended supervision, if any."""
        if self._failure is not None:
            raise self._failure

    def records(self) -> list[dict]:
        with self._lock:
            return [r.to_dict() for r in self.restarts]

    def _loop(self) -> None:
        while not self._closing.wait(self.interval_s):
            self.tick()

    def tick(self) -> None:
        """One pass: notice crashes, start what is due."""
        with self._lock:
            if self._stopping.is_set() or self._failure is not None:
                return
            for name, service in self._services.items():
                state = self._states[name]
                now = self.clock()
                if state.due is not None:
                    if now >= state.due:
                        self._restart(service, state)
                    continue
                code = service.returncode()
                if code is None or service.done(code):
                    continue
                self._crashed(service, state, code, now)
                if self._failure is not None:
                    return

    def _crashed(self, service: Supervised, state: _State, code: int, now: float) -> None:
        cfg = self.config
        exit_code, signal_name = describe_exit(code)
        how = f"signal {signal_name}" if signal_name else f"code {exit_code}"
        while state.crashes and now - state.crashes[0] > cfg.window_s:
            state.crashes.popleft()
        state.crashes.append(now)
        if cfg.policy == "never" or len(state.crashes) > cfg.max_restarts:
            budget = ("services.restart.policy is never" if cfg.policy == "never" else
                      f"it crashed {len(state.crashes)} times within {cfg.window_s:g} s, more "
                      f"than services.restart.max_restarts ({cfg.max_restarts})")
            self._failure = CrashLoop(
                f"{service.name} exited with {how} and is not restarted: {budget}; last log "
                f"lines:\n{service.log_tail()}")
            return
        if now - state.started_at >= cfg.reset_after_s:
            state.consecutive = 0
        state.consecutive += 1
        backoff = cfg.backoff_s(state.consecutive)
        state.due = now + backoff
        state.pending = Restart(service.name, exit_code, signal_name,
                                datetime.now(UTC).isoformat(timespec="milliseconds"),
                                round(backoff, 3))
        log.warning("%s exited with %s; restarting in %.1f s (restart %d within %g s)",
                    service.name, how, backoff, len(state.crashes), cfg.window_s)

    def _restart(self, service: Supervised, state: _State) -> None:
        record, state.due, state.pending = state.pending, None, None
        try:
            service.restart()
        except Exception:  # seen dead again at the next tick, within the budget
            log.exception("restarting %s failed", service.name)
        state.started_at = self.clock()
        if record is not None:
            record.restarted_after_s = round(state.started_at - state.crashes[-1], 3)
            self.restarts.append(record)
