"""A finished process ends without the interpreter's teardown (infra/process.py
``exit_without_teardown``), yet does everything an exit must: threads joined, ``atexit`` hooks
run, buffered output written, the status kept. Each case runs in its own Python process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from ance_train.infra.process import exit_code

PRELUDE = """
import atexit, sys, threading, time
from pathlib import Path
from ance_train.infra.process import exit_without_teardown
out = Path(sys.argv[1])
"""


def run(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "case.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                          text=True, timeout=60)


def test_exit_code_is_that_of_sys_exit(capsys) -> None:
    assert exit_code(None) == 0 and exit_code(0) == 0 and exit_code(7) == 7
    assert exit_code("bad config") == 1
    assert capsys.readouterr().err == "bad config\n"


def test_threads_hooks_and_buffered_output_are_finished_before_the_exit(tmp_path: Path) -> None:
    result = run(tmp_path, """
        def late():
            time.sleep(0.3)
            (out / "thread").write_text("joined")
        threading.Thread(target=late).start()  # not a daemon: an exit waits for it
        atexit.register(lambda: (out / "hook").write_text("ran"))
        sys.stdout.write("buffered, no newline")  # a pipe: block-buffered until flushed
        exit_without_teardown(3)
        (out / "after").write_text("never")
        """)
    assert result.returncode == 3, result.stderr
    assert result.stdout == "buffered, no newline"
    assert (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "hook").read_text() == "ran"
    assert not (tmp_path / "after").exists()


def test_an_executor_left_running_gets_the_ordinary_exit(tmp_path: Path) -> None:
    """Its idle worker never ends by itself: after join_s the interpreter's own exit (which
    stops it) is used, with the same status and the same hooks."""
    result = run(tmp_path, """
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(1)
        pool.submit(lambda: None).result()
        atexit.register(lambda: (out / "hook").write_text("ran"))
        started = time.monotonic()
        try:
            exit_without_teardown(5, join_s=0.2)
        except SystemExit:
            (out / "fallback").write_text(f"{time.monotonic() - started:.3f}")
            raise
        """)
    assert result.returncode == 5, result.stderr
    assert (tmp_path / "hook").read_text() == "ran"
    assert 0.15 < float((tmp_path / "fallback").read_text()) < 5


def test_a_message_as_the_code_is_printed_and_gives_1(tmp_path: Path) -> None:
    result = run(tmp_path, "exit_without_teardown('the store is gone')\n")
    assert result.returncode == 1 and result.stderr == "the store is gone\n"


def test_the_cli_ends_with_its_status_and_output(tmp_path: Path) -> None:
    """``python -m ance_train.cli`` (how the launcher starts services) goes through ``main``:
    its output is complete and a failing command keeps its status."""
    started = time.monotonic()
    ok = subprocess.run([sys.executable, "-m", "ance_train.cli", "--version"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.startswith("ance-train "), ok.stderr
    missing = subprocess.run([sys.executable, "-m", "ance_train.cli", "validate", "--config",
                              str(tmp_path / "absent.yaml")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "absent.yaml" in missing.stdout + missing.stderr
    assert time.monotonic() - started < 60
