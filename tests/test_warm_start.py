"""Services forked from the zygote (launcher/zygote.py, launcher/warm_start.py) behave as the
cold ``python -m`` start they replace: the requested argv, environment, working directory and
log; their own session; their exit status (a signal as a negative code); fresh random draws;
their command line in ``ps``; and no process outlives the launcher or a lost zygote. A
warm-start server (``zygote --listen``) serves several launchers, each with its own children's
exits, and ends a launcher's children when that launcher goes.

Real processes throughout: a zygote (preloading ``decimal`` and numpy, not torch, to stay
quick) forking ``python -m ance_train_dev.warm_child``. Every end-to-end run of the suite starts
its trainer and inferencers this way (services.warm_start is on by default; test_restarts
checks which service started how); test_api's dying-service run starts all of them cold
(warm_start off), as do the runs with GPUs (test_gpu_placement) and torchrun trainers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from ance_train.launcher.warm_start import WarmStarter, WarmStartError
from ance_train.launcher.zygote import import_settings

from ance_train_dev.service_harness import wait_until

CHILD = [sys.executable, "-m", "ance_train_dev.warm_child"]


@pytest.fixture
def starter(tmp_path: Path) -> Iterator[WarmStarter]:
    zygote = WarmStarter(dict(os.environ), tmp_path / "zygote.log", str(tmp_path),
                         preload=("decimal", "numpy")).start()
    yield zygote
    zygote.close()


def _report(log: Path) -> dict:
    line = wait_until(lambda: log.is_file() and log.read_text().splitlines()[:1], 60,
                      f"the child's report in {log}")
    return json.loads(line[0])


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_warm_child_gets_the_argv_environment_directory_and_log_asked_for(
        starter: WarmStarter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    # (and what the zygote read at import, which a warm child cannot differ in: under
    # scripts/dev/avx2_only.sh, its CPU dispatch variables)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
           "ONLY_HERE": "1", **import_settings(os.environ)}
    log = tmp_path / "child.log"
    log.write_text("")  # appended to, as the launcher's logs are across restarts
    child = starter.spawn([*CHILD, "exit", "7"], env, log)
    assert child.wait(60) == 7 and child.poll() == 7
    report = _report(log)
    assert report["argv"][1:] == ["exit", "7"]
    assert report["argv"][0].endswith("ance_train_dev/warm_child.py")
    assert report["env"] == env  # exactly: nothing of the zygote's environment leaks in
    assert report["cwd"] == str(work)
    assert report["pid"] == child.pid and report["sid"] == child.pid  # its own session
    assert report["stdin"] == ""  # /dev/null
    assert report["found_preloaded"] and starter.ready is not None
    assert "decimal" in starter.ready["ready"]


def test_stderr_an_exception_and_a_signal_end_as_popen_would_say(starter: WarmStarter,
                                                                  tmp_path: Path) -> None:
    env = dict(os.environ)
    said = starter.spawn([*CHILD, "stderr", "to the log too"], env, tmp_path / "said.log")
    assert said.wait(60) == 0
    assert "to the log too" in (tmp_path / "said.log").read_text()

    raised = starter.spawn([*CHILD, "raise"], env, tmp_path / "raised.log")
    assert raised.wait(60) == 1
    assert "RuntimeError: the child's own error" in (tmp_path / "raised.log").read_text()

    sleeper = starter.spawn([*CHILD, "sleep"], env, tmp_path / "sleeper.log")
    _report(tmp_path / "sleeper.log")
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(0.3)
    assert sleeper.poll() is None
    # What ps and pgrep -f show is the command a cold start would have run.
    # (one string, the title; /proc pads it with NULs, which psutil splits on)
    assert " ".join(psutil.Process(sleeper.pid).cmdline()).split() == [*CHILD, "sleep"]
    sleeper.kill()
    assert sleeper.wait(30) == -signal.SIGKILL
    sleeper.kill()  # a second signal to an ended process reaches nobody, and does not fail


def test_each_child_draws_its_own_random_numbers(starter: WarmStarter, tmp_path: Path) -> None:
    draws = []
    for name in ("a", "b"):
        child = starter.spawn([*CHILD, "exit", "0"], dict(os.environ), tmp_path / f"{name}.log")
        assert child.wait(60) == 0
        report = _report(tmp_path / f"{name}.log")
        draws.append((report["random"], report["numpy_random"]))
    assert draws[0][0] != draws[1][0] and draws[0][1] != draws[1][1]


def test_a_lost_zygote_takes_its_children_and_the_next_spawn_starts_another(
        starter: WarmStarter, tmp_path: Path) -> None:
    sleeper = starter.spawn([*CHILD, "sleep"], dict(os.environ), tmp_path / "s.log")
    _report(tmp_path / "s.log")
    first = starter._zygote
    assert first is not None
    os.kill(first.pid, signal.SIGKILL)
    assert sleeper.wait(30) == -signal.SIGKILL
    wait_until(lambda: _gone(sleeper.pid), 30, "the lost zygote's child to end")
    again = starter.spawn([*CHILD, "exit", "3"], dict(os.environ), tmp_path / "again.log")
    assert again.wait(60) == 3
    assert starter._zygote is not None and starter._zygote.pid != first.pid


def test_the_zygote_and_its_children_die_with_the_launcher(tmp_path: Path) -> None:
    """The launcher SIGKILLed: the kernel kills its zygote (PDEATHSIG), whose children get
    SIGTERM the same way."""
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        from ance_train.launcher.warm_start import WarmStarter
        starter = WarmStarter(dict(os.environ), Path({str(tmp_path / 'z.log')!r}), "x",
                              preload=("decimal",)).start()
        child = starter.spawn({[*CHILD, 'sleep']!r}, dict(os.environ),
                              Path({str(tmp_path / 'c.log')!r}))
        print(starter._zygote.pid, child.pid, flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    zygote, child = map(int, launcher.stdout.readline().split())
    _report(tmp_path / "c.log")
    launcher.kill()
    launcher.wait()
    wait_until(lambda: _gone(zygote) and _gone(child), 30,
               "the zygote and its child to die with the launcher")


def test_close_ends_the_zygote_and_only_python_m_is_started(starter: WarmStarter,
                                                            tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="-m MODULE"):
        starter.spawn([sys.executable, "-c", "pass"], dict(os.environ), tmp_path / "x.log")
    zygote = starter._zygote
    assert zygote is not None and zygote.poll() is None
    starter.close()
    assert zygote.poll() is not None and not starter.alive()


# -- a warm-start server (zygote --listen): one zygote for many launchers ------------------
@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    path = str(tmp_path / "warm.sock")
    with open(tmp_path / "server.log", "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "ance_train.launcher.zygote", "--listen", path,
             "--preload", "decimal,numpy", "--label", "test server"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_until(lambda: Path(path).exists(), 60, "the server's socket")
    yield path
    process.terminate()
    process.wait(30)


def _client(tmp_path: Path, server: str, name: str) -> WarmStarter:
    return WarmStarter(dict(os.environ), tmp_path / f"{name}.log", name,
                       preload=("decimal",), server=server).start()


def test_two_launchers_share_a_server_and_each_ends_only_its_own_children(
        server: str, tmp_path: Path) -> None:
    first, second = _client(tmp_path, server, "first"), _client(tmp_path, server, "second")
    assert first.shared and second.shared and first._zygote is None
    assert first.ready is not None and "decimal" in first.ready["ready"]
    mine = first.spawn([*CHILD, "sleep"], dict(os.environ), tmp_path / "mine.log")
    theirs = second.spawn([*CHILD, "sleep"], dict(os.environ), tmp_path / "theirs.log")
    mine_report, theirs_report = _report(tmp_path / "mine.log"), _report(tmp_path / "theirs.log")
    assert mine_report["found_preloaded"] and mine_report["sid"] == mine.pid
    assert mine_report["random"] != theirs_report["random"]
    # Exits go to the launcher that asked: each sees its own child's code, not the other's.
    quick = second.spawn([*CHILD, "exit", "5"], dict(os.environ), tmp_path / "quick.log")
    assert quick.wait(60) == 5 and mine.poll() is None and first._live.keys() == {mine.pid}
    # The first launcher goes: the server ends its child (SIGTERM), and only that one.
    first.close()
    wait_until(lambda: _gone(mine.pid), 30, "the closed launcher's child to end")
    assert theirs.poll() is None and not _gone(theirs.pid)
    theirs.terminate()
    assert theirs.wait(30) == -signal.SIGTERM
    second.close()


def test_a_launcher_killed_takes_its_children_from_the_server(server: str,
                                                              tmp_path: Path) -> None:
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, time
        from pathlib import Path
        from ance_train.launcher.warm_start import WarmStarter
        starter = WarmStarter(dict(os.environ), Path({str(tmp_path / 'z.log')!r}), "x",
                              server={server!r}).start()
        assert starter.shared
        child = starter.spawn({[*CHILD, 'sleep']!r}, dict(os.environ),
                              Path({str(tmp_path / 'c.log')!r}))
        print(child.pid, flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    child = int(launcher.stdout.readline())
    _report(tmp_path / "c.log")
    launcher.kill()
    launcher.wait()
    wait_until(lambda: _gone(child), 30, "the killed launcher's child to end")
    # The server itself serves on.
    after = _client(tmp_path, server, "after")
    assert after.spawn([*CHILD, "exit", "0"], dict(os.environ), tmp_path / "a.log").wait(60) == 0
    after.close()


def test_no_server_or_another_environment_falls_back(server: str, tmp_path: Path) -> None:
    """No server at the path: the launcher starts a zygote of its own. A process whose
    environment differs in what is read at import time is refused (the launcher then starts
    it cold): the server's imports read the server's values."""
    own = _client(tmp_path, str(tmp_path / "nobody.sock"), "own")
    assert own.alive() and not own.shared and own._zygote is not None
    assert own.spawn([*CHILD, "exit", "0"], dict(os.environ), tmp_path / "o.log").wait(60) == 0
    own.close()
    shared = _client(tmp_path, server, "shared")
    # What libraries set for themselves as they run (threadpoolctl, torch) is no difference.
    drifted = dict(os.environ, KMP_DUPLICATE_LIB_OK="True", TORCHINDUCTOR_CACHE_DIR="/tmp/x")
    assert shared.spawn([*CHILD, "exit", "0"], drifted, tmp_path / "d.log").wait(60) == 0
    with pytest.raises(WarmStartError, match="HF_HUB_OFFLINE, which are read at import time"):
        shared.spawn([*CHILD, "exit", "0"], dict(os.environ, HF_HUB_OFFLINE="1"),
                     tmp_path / "hub.log")
    shared.close()
