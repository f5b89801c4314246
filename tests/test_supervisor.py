"""The supervisor's CrashLoopBackOff on real processes: the back-off doubles with each
consecutive crash up to its cap, is forgotten once a process has run ``reset_after_s``, and
the budget (``max_restarts`` within ``window_s``) ends supervision naming the service."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

from ance_train.config import RestartConfig
from ance_train.infra.process import die_with_parent
from ance_train.launcher.supervisor import CrashLoop, Supervisor, describe_exit


@dataclass
class Command:
    """A process started from ``argv``; ``starts`` records when each start happened."""

    name: str
    argv: list[str]
    starts: list[float] = field(default_factory=list)
    process: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        self.restart()

    def returncode(self) -> int | None:
        return self.process.poll()

    def done(self, code: int) -> bool:
        return code == 0

    def restart(self) -> None:
        self.starts.append(time.monotonic())
        self.process = subprocess.Popen(self.argv)

    def log_tail(self) -> str:
        return "the last words"


def crash_after(seconds: float) -> list[str]:
    return [sys.executable, "-c", f"import time, sys; time.sleep({seconds}); sys.exit(3)"]


def test_backoff_doubles_to_its_cap_and_the_budget_stops_a_crash_loop() -> None:
    config = RestartConfig(initial_backoff_s=0.2, max_backoff_s=0.8, reset_after_s=30,
                           max_restarts=4, window_s=60)
    assert [config.backoff_s(n) for n in (1, 2, 3, 4)] == [0.2, 0.4, 0.8, 0.8]
    supervisor = Supervisor(config, interval_s=0.02)
    service = Command("crasher", crash_after(0))
    supervisor.add(service)
    supervisor.start()
    try:
        deadline = time.monotonic() + 30
        with pytest.raises(CrashLoop) as stopped:
            while time.monotonic() < deadline:
                supervisor.check()
                time.sleep(0.05)
    finally:
        supervisor.close()
    assert str(stopped.value).startswith(
        "crasher exited with code 3 and is not restarted: it crashed 5 times within 60 s, "
        "more than services.restart.max_restarts (4); last log lines:\nthe last words")
    records = supervisor.records()
    assert [r["backoff_s"] for r in records] == [0.2, 0.4, 0.8, 0.8]
    assert all(r["exit_code"] == 3 and r["signal"] is None for r in records)
    gaps = [b - a for a, b in zip(service.starts, service.starts[1:], strict=False)]
    for gap, record in zip(gaps, records, strict=True):
        assert gap >= record["backoff_s"]
        assert record["restarted_after_s"] >= record["backoff_s"]


def test_a_process_that_ran_long_enough_restarts_with_the_initial_backoff() -> None:
    config = RestartConfig(initial_backoff_s=0.1, max_backoff_s=10, reset_after_s=0.5,
                           max_restarts=10, window_s=60)
    supervisor = Supervisor(config, interval_s=0.02)
    service = Command("slow-crasher", crash_after(0.7))  # runs longer than reset_after_s
    supervisor.add(service)
    supervisor.start()
    try:
        while len(supervisor.records()) < 3:
            supervisor.check()
            time.sleep(0.05)
    finally:
        supervisor.close()
        service.process.kill()
    assert [r["backoff_s"] for r in supervisor.records()[:3]] == [0.1, 0.1, 0.1]


def test_never_stops_at_the_first_crash_and_a_finished_service_is_left_alone() -> None:
    supervisor = Supervisor(RestartConfig(policy="never"), interval_s=0.02)
    finished = Command("finisher", [sys.executable, "-c", "pass"])
    crasher = Command("crasher", crash_after(0.3))
    supervisor.add(finished)
    supervisor.add(crasher)
    supervisor.start()
    try:
        with pytest.raises(CrashLoop, match=r"services\.restart\.policy is never"):
            for _ in range(200):
                supervisor.check()
                time.sleep(0.05)
    finally:
        supervisor.close()
    assert finished.starts[1:] == [] and crasher.starts[1:] == []
    assert describe_exit(-9) == (None, "SIGKILL") and describe_exit(1) == (1, None)


def test_restarted_processes_outlive_pause_and_die_with_the_thread_on_close() -> None:
    """A child started with PDEATHSIG dies when the *thread* that forked it ends: pausing the
    supervisor (the launcher's tear-down, which still needs Redis) must not kill what it
    restarted; closing it does (what the launcher calls last)."""
    config = RestartConfig(initial_backoff_s=0.05, max_backoff_s=0.05)
    supervisor = Supervisor(config, interval_s=0.02)
    service = Command("once", crash_after(0))
    supervisor.add(service)
    service.argv = [sys.executable, "-c", "import time; time.sleep(60)"]  # the next starts
    service.restart = lambda: _start_dying_with_parent(service)  # type: ignore[method-assign]
    supervisor.start()
    try:
        while not supervisor.records():
            time.sleep(0.05)
        restarted = service.process
        supervisor.pause()
        time.sleep(0.5)
        assert restarted.poll() is None, "the restarted process died with pause()"
    finally:
        supervisor.close()
    assert restarted.wait(timeout=10) == -signal.SIGTERM


def _start_dying_with_parent(service: Command) -> None:
    service.starts.append(time.monotonic())
    service.process = subprocess.Popen(service.argv, preexec_fn=die_with_parent)
