"""The suite profiler (dev/ance_train_dev/suite_profile.py), run as a pytest plugin on a small
test file in a pytest of its own: a row per test with its wall time and the machine's
CPU-seconds, and the per-module summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ance_train_dev.suite_profile import PROFILE_VAR, by_module


def test_each_test_gets_its_wall_time_and_the_machines_cpu(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(
        "import time\n"
        "def test_busy():\n"
        "    end = time.process_time() + 0.3\n"
        "    while time.process_time() < end:\n"
        "        pass\n"
        "def test_idle():\n"
        "    time.sleep(0.3)\n")
    out = tmp_path / "profile.json"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
         "ance_train_dev.suite_profile", "-p", "no:xdist", "test_sample.py"],
        cwd=tmp_path, capture_output=True, text=True, env={**os.environ, PROFILE_VAR: str(out)},
        timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {row["test"]: row for row in json.loads(out.read_text())}
    busy, idle = rows["test_sample.py::test_busy"], rows["test_sample.py::test_idle"]
    assert busy["cpu_s"] >= 0.25 and busy["wall_s"] >= 0.3
    assert idle["wall_s"] >= 0.3
    assert "suite profile:" in done.stdout and "test_sample.py" in done.stdout


def test_modules_are_summed_and_the_costliest_comes_first() -> None:
    rows = [{"test": "tests/a.py::x", "cpu_s": 1.0, "wall_s": 2.0},
            {"test": "tests/b.py::y", "cpu_s": 3.0, "wall_s": 1.0},
            {"test": "tests/a.py::z", "cpu_s": 4.0, "wall_s": 0.5}]
    assert by_module(rows) == [("tests/a.py", 5.0, 2.5, 2), ("tests/b.py", 3.0, 1.0, 1)]
