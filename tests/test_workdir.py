"""One service process per work directory (``infra/workdir.py``): real processes holding
real POSIX locks; the chart's pods once shared one ``/work`` and a trainer's checkpoint
folder filled with an inferencer's downloads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ance_train.infra.workdir import LOCK_FILE, WorkDirInUse, claim_work_dir

HOLD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from ance_train.infra.workdir import claim_work_dir
    claim_work_dir(Path(sys.argv[1]), "inferencer")
    if sys.argv[2] == "fork":  # a child (a DataLoader worker) outlives the claimant
        if os.fork() == 0:
            print("child", os.getpid(), flush=True)
            time.sleep(60)
            os._exit(0)
        time.sleep(0.2)
        print("claimed", flush=True)
        os._exit(0)
    print("claimed", flush=True)
    time.sleep(60)
""")


def hold(directory: Path, mode: str = "hold") -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), mode],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return process


def wait_line(process: subprocess.Popen[str], word: str) -> str:
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith(word), line
    return line


def test_a_second_process_is_refused_naming_the_directory_and_the_holder(tmp_path: Path):
    work = tmp_path / "work"
    holder = hold(work)
    try:
        wait_line(holder, "claimed")
        with pytest.raises(WorkDirInUse) as refused:
            claim_work_dir(work, "trainer")
        message = str(refused.value)
        assert str(work.resolve()) in message
        assert f"inferencer, pid {holder.pid}" in message
        assert "--work-dir" in message
    finally:
        holder.kill()
        holder.wait()
    # Killed without a chance to clean up: the kernel dropped the lock, no waiting.
    assert claim_work_dir(work, "trainer") == work.resolve()
    assert "trainer, pid" in (work / LOCK_FILE).read_text()


def test_a_forked_child_does_not_keep_the_directory(tmp_path: Path):
    work = tmp_path / "work"
    claimant = hold(work, "fork")
    child_pid = int(wait_line(claimant, "child").split()[1])
    try:
        wait_line(claimant, "claimed")
        claimant.wait(timeout=10)
        os.kill(child_pid, 0)  # still alive, holding the inherited descriptor
        assert claim_work_dir(work, "inferencer") == work.resolve()
    finally:
        os.kill(child_pid, signal.SIGKILL)


def test_claiming_again_in_the_same_process_is_a_no_op(tmp_path: Path):
    first = claim_work_dir(tmp_path / "w", "indexer")
    assert claim_work_dir(tmp_path / "w", "indexer") == first
    holder = hold(tmp_path / "w")
    try:  # still held by this process: the other one fails
        assert holder.wait(timeout=30) != 0
    finally:
        holder.kill()


def test_serve_refuses_a_work_dir_in_use_before_connecting(tmp_path: Path, tiny_model: Path,
                                                          scifact_subset: Path):
    """The CLI's error names the folder; nothing listens at the Redis URL, so a process that
    got past the claim would have failed on Redis instead."""
    from ance_train_dev.helpers import write_config

    config = write_config(tmp_path / "config.yaml", run_id="workdir",
                          data={"path": str(scifact_subset)}, model={"path": str(tiny_model)})
    work = tmp_path / "work"
    holder = hold(work)
    try:
        wait_line(holder, "claimed")
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "ance_train.cli", "serve", "indexer", "--config",
             str(config), "--redis-url", "redis://127.0.0.1:9", "--work-dir", str(work),
             "--store-dir", str(tmp_path / "store")],
            capture_output=True, text=True, timeout=120)
        assert done.returncode == 1, done.stderr
        assert "is in use by another ance-train process" in done.stderr
        assert str(work.resolve()) in done.stderr.replace("\n", "")
        assert time.monotonic() - started < 60
    finally:
        holder.kill()
        holder.wait()
