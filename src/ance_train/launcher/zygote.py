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
``ready`` message also says what a child inherits that its own environment cannot change: the
interpreter (``executable``), where ``ance_train`` was imported from (``package``), and the
variables read at import time (``env``, those of :data:`IMPORT_SETTINGS`). The zygote exits when
the socket closes.

With ``--listen PATH`` instead of ``--fd``, one zygote serves many launchers (a warm-start
server: a sweep of runs on one machine, or the test suite's runs, share one set of imports).
Each connection gets its own ``ready`` and the exits of its own children only; when a
connection closes (its launcher stopped or died), the zygote sends ``SIGTERM`` to that
connection's children that are still running, as the kernel does for a zygote's children when
that zygote dies. The server runs until it gets ``SIGTERM`` or its parent dies.
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
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any, NoReturn

from ance_train.infra.process import die_with_parent, exit_code, exit_without_teardown

MAX_MESSAGE = 1 << 20  # bytes; a request carries the environment
# Environment variables read once, when a library is imported or first used, that change what
# a service computes or where it reads from: the code's path, the Hugging Face Hub's offline
# mode, endpoint and caches, CPU dispatch (docs/testing.md's AVX2 emulation) and thread pools.
# A forked child keeps the zygote's, whatever its own environment says, so a request whose
# values differ is refused (warm_start.WarmStarter.spawn) and that service starts cold. Not
# those that libraries set for themselves as they run (threadpoolctl's KMP_DUPLICATE_LIB_OK,
# the OpenMP runtime's KMP_INIT_AT_FORK, torch's TORCHINDUCTOR_CACHE_DIR, runtime.py's progress
# bar switch, which a service applies itself): they would refuse every start after them.
IMPORT_SETTINGS = frozenset({
    "PYTHONPATH", "PYTHONHOME",
    "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_TOKEN", "HF_HUB_ETAG_TIMEOUT",
    "HF_HUB_DOWNLOAD_TIMEOUT",
    "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
    "NPY_DISABLE_CPU_FEATURES", "FAISS_SIMD_LEVEL", "FAISS_OPT_LEVEL",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS",
})


PACKAGE = str(Path(__file__).resolve().parents[1])  # the ance_train a child runs


def import_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that a process reads when importing (:data:`IMPORT_SETTINGS`);
    an empty one counts as unset, as these libraries read it."""
    return {key: value for key, value in env.items() if key in IMPORT_SETTINGS and value}


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


class Zygote:
    """The fork loop: a child per request, every child's exit reported to the connection that
    asked for it. ``listener`` (``--listen``) accepts connections until the process is
    stopped; without it, the one connection's end ends the loop."""

    def __init__(self, ready: dict[str, Any], listener: socket.socket | None = None) -> None:
        self.ready = ready
        self.listener = listener
        self.clients: dict[int, socket.socket] = {}  # by file descriptor
        self.owners: dict[int, socket.socket | None] = {}  # child pid → its connection
        self.pid = os.getpid()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd is the notification

    def add(self, client: socket.socket) -> bool:
        """Greet a new connection with ``ready``; False when it is already gone."""
        try:
            send(client, self.ready)
        except OSError:
            client.close()
            return False
        self.clients[client.fileno()] = client
        return True

    def serve(self) -> None:
        while self.clients or self.listener is not None:
            waiting = [self.wake_r, *self.clients]
            if self.listener is not None:
                waiting.append(self.listener.fileno())
            readable, _, _ = select.select(waiting, [], [])
            asking = [self.clients[fd] for fd in readable if fd in self.clients]
            if self.wake_r in readable:
                os.read(self.wake_r, 4096)
            self.report_exits()
            if self.listener is not None and self.listener.fileno() in readable:
                with suppress(OSError):  # a client that gave up before being accepted
                    self.add(self.listener.accept()[0])
            for client in asking:
                if self.clients.get(client.fileno()) is client:  # not dropped meanwhile
                    self.answer(client)

    def answer(self, client: socket.socket) -> None:
        try:
            request = receive(client)
        except OSError:
            request = None
        if request is None:
            self.drop(client)
            return
        try:
            pid = os.fork()
        except OSError as error:  # out of memory or processes: the launcher says so
            self.send(client, {"id": request["id"], "error": f"fork failed: {error}"})
            return
        if pid == 0:
            _become(request, self.pid, self._fds())
        self.owners[pid] = client
        self.send(client, {"id": request["id"], "pid": pid})

    def send(self, client: socket.socket, message: dict[str, Any]) -> None:
        try:
            send(client, message)
        except OSError:  # that launcher is gone
            self.drop(client)

    def drop(self, client: socket.socket) -> None:
        """A connection ended: its children still running get SIGTERM (their own sessions:
        the whole group), as from the kernel when a zygote of their own dies."""
        if self.clients.pop(client.fileno(), None) is None:
            return
        for pid, owner in self.owners.items():
            if owner is client:
                self.owners[pid] = None
                with suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGTERM)
        client.close()

    def report_exits(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            owner = self.owners.pop(pid, None)
            if owner is not None:
                self.send(owner, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})

    def _fds(self) -> list[int]:
        """What a forked child must close: every socket and the wakeup pipe."""
        fds = [self.wake_r, self.wake_w, *self.clients]
        if self.listener is not None:
            fds.append(self.listener.fileno())
        return fds


def _become(request: dict[str, Any], zygote: int, fds: list[int]) -> NoReturn:
    """In the forked child: drop the zygote's sockets and signal set-up, turn into
    ``python -m <module> <args>`` with the request's environment, working directory and log,
    then run it. Never returns."""
    code: object = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in fds:
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


def listen(path: str) -> socket.socket:
    """The ``--listen`` socket, readable by this user only; bound before the imports, so a
    launcher that connects meanwhile waits for ``ready`` instead of failing."""
    Path(path).unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(64)
    return listener


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ance_train.launcher.zygote")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--fd", type=int, help="the SOCK_SEQPACKET socket of its one launcher")
    where.add_argument("--listen", help="a Unix socket path to serve many launchers on")
    parser.add_argument("--preload", default="", help="comma-separated modules to import")
    parser.add_argument("--encoder-type", default=None, help="config.json's model_type")
    parser.add_argument("--label", default="", help="the run directory, for ps and pgrep -f")
    options = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when services stop
    listener = listen(options.listen) if options.listen else None
    done, failed = preload([m for m in options.preload.split(",") if m], options.encoder_type)
    for name, error in failed.items():
        print(f"zygote: preloading {name} failed: {error}", file=sys.stderr, flush=True)
    ready = {"ready": done, "failed": failed, "executable": sys.executable,
             "package": PACKAGE, "env": import_settings(os.environ)}
    zygote = Zygote(ready, listener)
    if listener is None and not zygote.add(socket.socket(fileno=options.fd)):
        return
    zygote.serve()


if __name__ == "__main__":
    main()
    os._exit(0)  # nothing to tear down that a child might still share
