"""A pytest plugin that records, per test, its wall time and the CPU-seconds the whole machine
spent meanwhile (``/proc/stat``: the services, servers and subprocesses a test starts are in
it, which pytest's ``--durations`` and any in-process profiler miss). Meaningful with one
worker (``-n 0``) on an otherwise idle machine; it is how issue 29's suite time was split up.

    python -m pytest -p ance_train_dev.suite_profile -n 0 -q
    # then: ANCE_SUITE_PROFILE (default suite-profile.json), one row per test, and the
    # modules costing the most CPU on stdout at the end
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

PROFILE_VAR = "ANCE_SUITE_PROFILE"
_rows: list[dict] = []


def machine_cpu_seconds() -> float:
    """user + nice + system time of every CPU since boot."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()
    return sum(int(x) for x in fields[1:4]) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    wall, cpu = time.monotonic(), machine_cpu_seconds()
    yield
    _rows.append({"test": item.nodeid, "wall_s": round(time.monotonic() - wall, 2),
                  "cpu_s": round(machine_cpu_seconds() - cpu, 2)})


def by_module(rows: list[dict]) -> list[tuple[str, float, float, int]]:
    """(module, CPU-s, wall s, tests), the costliest first."""
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for row in rows:
        totals = modules[row["test"].split("::", 1)[0]]
        totals[0] += row["cpu_s"]
        totals[1] += row["wall_s"]
        totals[2] += 1
    return sorted(((m, c, w, int(n)) for m, (c, w, n) in modules.items()),
                  key=lambda entry: -entry[1])


def pytest_terminal_summary(terminalreporter) -> None:
    if not _rows:
        return
    out = Path(os.environ.get(PROFILE_VAR, "suite-profile.json"))
    out.write_text(json.dumps(_rows, indent=1) + "\n")
    write = terminalreporter.write_line
    write(f"suite profile: {sum(r['cpu_s'] for r in _rows):.0f} machine CPU-s, "
          f"{sum(r['wall_s'] for r in _rows):.0f} s in tests; per test in {out}")
    for module, cpu, wall, count in by_module(_rows)[:15]:
        write(f"  {cpu:7.1f} CPU-s {wall:7.1f} s {count:4d} tests  {module}")
