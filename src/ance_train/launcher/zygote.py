"""The embedded mode's zygote: one process that imports torch and transformers once, then forks
each trainer and inferencer process from that state (``python -m ance_train.launcher.zygote``).

Every service started cold spends 4–6 CPU-seconds importing torch and transformers before it
does anything (docs/testing.md measures it); a run starts a trainer and ``inference.replicas``
inferencers, and the supervisor starts them again after a crash. A forked child has the
modules already: it becomes the service in milliseconds. The idea is Android's zygote and
Python's ``multiprocessing`` forkserver; the latter is not used because it starts Python
functions under its own bootstrap (it re-imports the parent's ``__main__``, keeps one server
per interpreter for its lifetime, and joins children at exit), while a service must start as
``python -m ance_train.cli serve ...`` would, with the run's environment.

Each forked child behaves as that command would have: its own session (``setsid``, as
``start_new_session``), stdout and stderr appended to its log, stdin from /dev/null, exactly
the requested environment and working directory, its command line as its process title
(``ps``, ``pgrep -f``), fresh random seeds, and ``SIGTERM`` when the zygote dies
(``PR_SET_PDEATHSIG``; the zygote itself dies with the launcher). The client side is
:mod:`ance_train.launcher.warm_start`.

Protocol, over a ``SOCK_SEQPACKET`` socket the launcher passes as ``--fd`` (one JSON object
per message): the zygote sends ``{"ready": [preloaded modules], "failed": {module: error}}``
once its imports are done; a request ``{"id", "module", "args", "env", "cwd", "log", "title"}``
is answered ``{"id", "pid"}`` (or ``{"id", "error"}``); every child's end is reported as
``{"exited": pid, "code"}`` (``Popen.returncode``'s convention: negative for a signal). The
zygote exits when the socket closes.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import random
import runpy
import select
import signal
import socket
import sys
import traceback
from typing import Any, NoReturn

from ance_train.infra.process import die_with_parent, exit_code, exit_without_teardown

MAX_MESSAGE = 1 << 20  # bytes; a request carries the environment


def send(channel: socket.socket, message: dict[str, Any]) -> None:
    channel.send(json.dumps(message).encode())


def receive(channel: socket.socket) -> dict[str, Any] | None:
    """The next message, or None once the other side has closed."""
    data = channel.recv(MAX_MESSAGE)
    return json.loads(data) if data else None


def preload(modules: list[str], encoder_type: str | None) -> tuple[list[str], dict[str, str]]:
    """Import ``modules`` and the transformers model code of ``encoder_type`` (``bert``): the
    names imported, and an error per name that failed (the service then imports, and reports,
    it itself)."""
    names, failed, done = list(modules), {}, []
    if encoder_type:
        try:
            from transformers.models.auto.configuration_auto import model_type_to_module_name

            module = model_type_to_module_name(encoder_type)
            names.append(f"transformers.models.{module}.modeling_{module}")
        except Exception as error:  # an unknown model type: the service will say so
            failed[f"model type {encoder_type}"] = repr(error)
    for name in names:
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception as error:
            failed[name] = repr(error)
    return done, failed


def serve(channel: socket.socket) -> None:
    """Fork a child per request and report every child's exit, until the socket closes."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd is the notification
    zygote = os.getpid()
    try:
        while True:
            readable, _, _ = select.select([channel.fileno(), wake_r], [], [])
            if wake_r in readable:
                os.read(wake_r, 4096)
            _report_exits(channel)
            if channel.fileno() in readable:
                request = receive(channel)
                if request is None:
                    return
                try:
                    pid = os.fork()
                except OSError as error:  # out of memory or processes: the launcher says so
                    send(channel, {"id": request["id"], "error": f"fork failed: {error}"})
                    continue
                if pid == 0:
                    _become(request, zygote, channel, (wake_r, wake_w))
                send(channel, {"id": request["id"], "pid": pid})
    except (BrokenPipeError, ConnectionResetError):  # the launcher is gone
        return


def _report_exits(channel: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        send(channel, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _become(request: dict[str, Any], zygote: int, channel: socket.socket,
            wake: tuple[int, int]) -> NoReturn:
    """In the forked child: drop the zygote's socket and signal set-up, turn into
    ``python -m <module> <args>`` with the request's environment, working directory and log,
    then run it. Never returns."""
    code: object = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        channel.close()
        for fd in wake:
            os.close(fd)
        os.setsid()
        die_with_parent(signal.SIGTERM)
        if os.getppid() != zygote:  # the zygote died before the line above
            os._exit(1)
        _set_title(request["title"])  # first: it moves the original environment aside
        _redirect(request["log"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        _reseed()
        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as end:
        code = end.code
    except BaseException:
        traceback.print_exc()
        code = 1
    exit_without_teardown(exit_code(code))


def _redirect(log_path: str) -> None:
    """stdout and stderr appended to ``log_path``, stdin from /dev/null, unbuffered as the
    launcher's ``PYTHONUNBUFFERED=1`` makes a cold-started service."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's stdin, kept open
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False),  # noqa: SIM115
                                  write_through=True, line_buffering=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False),  # noqa: SIM115
                                  write_through=True, line_buffering=True,
                                  errors="backslashreplace")


def _set_title(title: str) -> None:
    """What ``ps`` and ``pgrep -f`` show: the command a cold start would have run."""
    try:
        import setproctitle
    except ImportError:  # the zygote's own command line then names the run
        return
    setproctitle.setproctitle(title)


def _reseed() -> None:
    """A forked child inherits the zygote's random state; a cold process draws its own. Seeds
    the services set themselves (training.seed) come later and win."""
    random.seed()
    if "numpy" in sys.modules:
        import numpy

        numpy.random.seed()
    if "torch" in sys.modules:
        import torch

        torch.seed()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ance_train.launcher.zygote")
    parser.add_argument("--fd", type=int, required=True, help="the SOCK_SEQPACKET socket")
    parser.add_argument("--preload", default="", help="comma-separated modules to import")
    parser.add_argument("--encoder-type", default=None, help="config.json's model_type")
    parser.add_argument("--label", default="", help="the run directory, for ps and pgrep -f")
    options = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when services stop
    channel = socket.socket(fileno=options.fd)
    done, failed = preload([m for m in options.preload.split(",") if m], options.encoder_type)
    for name, error in failed.items():
        print(f"zygote: preloading {name} failed: {error}", file=sys.stderr, flush=True)
    try:
        send(channel, {"ready": done, "failed": failed})
    except (BrokenPipeError, ConnectionResetError):
        return
    serve(channel)


if __name__ == "__main__":
    main()
    os._exit(0)  # nothing to tear down that a child might still share
