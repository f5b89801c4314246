"""Starting service processes warm: from a zygote that has imported torch and transformers
once (:mod:`ance_train.launcher.zygote`), instead of a fresh interpreter each time.

:class:`WarmStarter` runs the zygote and asks it for ``python -m <module> <args>`` processes;
each comes back as a :class:`WarmProcess`, which the launcher and the supervisor use as they
use a ``subprocess.Popen`` (:class:`ProcessHandle`: ``pid``, ``poll``, ``wait``,
``send_signal``, ``kill``). The children are the zygote's, so their exit statuses arrive as
messages from it. When the zygote dies, its children are killed (they would get SIGTERM from
the kernel anyway and take their grace period to stop, while the supervisor started their
replacements) and reported dead; the next :meth:`WarmStarter.spawn` starts another zygote.

A launcher whose environment names a warm-start server (:data:`SERVER_VAR`: the socket of a
``python -m ance_train.launcher.zygote --listen PATH``) asks that one instead of starting its
own, when it runs the same interpreter and ``ance_train``; otherwise it starts its own. A
sweep of runs on one machine, or the test suite, then pays for the imports once.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Protocol

from ance_train.infra.process import die_with_parent
from ance_train.launcher.zygote import PACKAGE, import_settings, receive, send

log = logging.getLogger(__name__)

# What the zygote imports besides the base model's transformers code: what the trainer and an
# inferencer spend their start on (docs/testing.md), and the pure-Python clients they all use.
# The services' own modules are left to the services: they import grpc, whose core is not
# meant to be forked once it runs.
PRELOAD = ("torch", "transformers.modeling_utils", "transformers.tokenization_utils_fast",
           "prometheus_client", "minio", "redis", "pydantic")
# The socket of a shared zygote (``--listen``) for launchers to use instead of their own.
SERVER_VAR = "ANCE_WARM_START_SERVER"


class ProcessHandle(Protocol):
    """What the launcher needs of a child process: ``subprocess.Popen``'s names."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class WarmStartError(RuntimeError):
    """The zygote could not start a process (it died, or did not answer in time)."""


def run_zygote(where: list[str], env: dict[str, str], log_path: Path, label: str,
               encoder_type: str | None = None, preload: tuple[str, ...] = PRELOAD,
               pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """``python -m ance_train.launcher.zygote`` with ``where`` (``--fd N`` or ``--listen
    PATH``), logging to ``log_path``: in its own session (Ctrl-C is the launcher's to handle),
    SIGKILLed when the thread that started it ends; its children get SIGTERM when it does."""
    args = [sys.executable, "-m", "ance_train.launcher.zygote", *where,
            "--preload", ",".join(preload), "--label", label]
    if encoder_type:
        args += ["--encoder-type", encoder_type]
    with open(log_path, "ab") as out:
        return subprocess.Popen(args, pass_fds=pass_fds, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: die_with_parent(signal.SIGKILL))


class WarmProcess:
    """A process the zygote forked; ``returncode`` as ``Popen``'s (negative: the signal)."""

    def __init__(self, starter: WarmStarter, pid: int, args: list[str]) -> None:
        self.starter = starter
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.starter.changed:
            if not self.starter.changed.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # never a pid the kernel may have given another process
            with suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmStarter:
    """A zygote for one run, started with the run's environment (what the preloaded modules
    read when imported) and logging to ``log_path``; ``label`` (the run directory) goes on its
    command line, so ``pgrep -f <run directory>`` finds it. With ``server`` (a ``--listen``
    socket path), that shared zygote is used instead where it can be (module docstring)."""

    def __init__(self, env: dict[str, str], log_path: Path, label: str,
                 encoder_type: str | None = None, preload: tuple[str, ...] = PRELOAD,
                 answer_timeout_s: float = 300.0, server: str | None = None) -> None:
        self.env = env
        self.server = server
        self.import_env: dict[str, str] = {}  # what the zygote's imports read (IMPORT_SETTINGS)
        self.shared = False  # the last start: a warm-start server's, not a zygote of our own
        self.log_path = log_path
        self.label = label
        self.encoder_type = encoder_type
        self.preload = preload
        self.answer_timeout_s = answer_timeout_s  # the first answer waits for the imports
        self.changed = threading.Condition()
        self.ready: dict | None = None  # the zygote's first message: what it preloaded
        self._channel: socket.socket | None = None
        self._zygote: subprocess.Popen | None = None
        self._answers: dict[int, WarmProcess | str] = {}
        self._live: dict[int, WarmProcess] = {}
        self._next_id = 0
        self._spawn_lock = threading.Lock()

    # -- the zygote ------------------------------------------------------------------------
    def start(self) -> WarmStarter:
        """Connect to the server, or start the zygote (its imports run while the caller goes
        on)."""
        if self.server:
            try:
                return self._connect(self.server)
            except (OSError, ValueError, WarmStartError) as error:
                log.warning("warm-start server %s not used (%s): starting a zygote of this "
                            "run's own", self.server, error)
        self.import_env, self.shared = import_settings(self.env), False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self._zygote = run_zygote(["--fd", str(theirs.fileno())], self.env, self.log_path,
                                      self.label, self.encoder_type, self.preload,
                                      pass_fds=(theirs.fileno(),))
        self._channel = ours
        threading.Thread(target=self._read, args=(ours, self._zygote), name="zygote-reader",
                         daemon=True).start()
        return self

    def _connect(self, path: str) -> WarmStarter:
        """Use the shared zygote at ``path`` if it runs this interpreter and ``ance_train``."""
        channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            channel.settimeout(self.answer_timeout_s)  # a server still importing answers late
            channel.connect(path)
            ready = receive(channel)
            if ready is None or "ready" not in ready:
                raise WarmStartError("it closed the connection")
            ours = {"executable": sys.executable, "package": PACKAGE}
            theirs = {key: ready.get(key) for key in ours}
            if theirs != ours:
                raise WarmStartError(f"it runs {theirs}, this launcher {ours}")
            channel.settimeout(None)
        except BaseException:
            channel.close()
            raise
        self.ready, self.import_env, self._zygote = ready, ready["env"], None
        self.shared = True
        self._channel = channel
        threading.Thread(target=self._read, args=(channel, None), name="zygote-reader",
                         daemon=True).start()
        return self

    def alive(self) -> bool:
        return self._channel is not None

    def close(self) -> None:
        """Stop the zygote (a child still running gets SIGTERM from the kernel)."""
        channel, self._channel = self._channel, None
        if channel is not None:
            with suppress(OSError):
                channel.shutdown(socket.SHUT_RDWR)
            channel.close()
        if self._zygote is not None:
            try:
                self._zygote.wait(10)
            except subprocess.TimeoutExpired:
                self._zygote.kill()
                self._zygote.wait()

    def _read(self, channel: socket.socket, zygote: subprocess.Popen | None) -> None:
        """The messages of one zygote: answers to :meth:`spawn`, and every child's exit."""
        try:
            while (message := receive(channel)) is not None:
                self._handle(message)
        except OSError:  # closed by close()
            pass
        self._lost(channel)
        if zygote is not None:
            with suppress(subprocess.TimeoutExpired):
                zygote.wait(5)  # reaped, not left a zombie (a newer zygote may be running)

    def _handle(self, message: dict) -> None:
        with self.changed:
            if "ready" in message:
                self.ready = message
                if message["failed"]:
                    log.warning("zygote: could not preload %s", message["failed"])
            elif "exited" in message:
                process = self._live.pop(message["exited"], None)
                if process is not None:
                    process.returncode = message["code"]
            elif "pid" in message:
                process = WarmProcess(self, message["pid"], [])
                self._live[process.pid] = process
                self._answers[message["id"]] = process
            else:
                self._answers[message["id"]] = message["error"]
            self.changed.notify_all()

    def _lost(self, channel: socket.socket) -> None:
        """The zygote is gone (or closed): its children are ended and reported killed."""
        with self.changed:
            if self._channel is channel:
                self._channel = None
            for process in self._live.values():
                with suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.returncode = -signal.SIGKILL
            self._live.clear()
            self.changed.notify_all()

    # -- processes -------------------------------------------------------------------------
    def spawn(self, argv: list[str], env: dict[str, str], log_path: Path) -> WarmProcess:
        """``argv`` (``[sys.executable, "-m", module, *args]``) forked from the zygote, with
        ``env`` as its whole environment, stdout and stderr appended to ``log_path``, and the
        caller's working directory. Starts a zygote first when the last one died.
        :class:`WarmStartError` when ``env`` differs from the zygote's in a variable read at
        import time (:data:`~ance_train.launcher.zygote.IMPORT_SETTINGS`): start it cold."""
        if argv[:2] != [sys.executable, "-m"] or len(argv) < 3:
            raise ValueError(f"a warm start runs `{sys.executable} -m MODULE ...`, not {argv}")
        # The log exists when this returns, as with a Popen given an open file (and a log
        # that cannot be written fails here, not in the child).
        with open(log_path, "ab"):
            pass
        with self._spawn_lock:
            if not self.alive():
                log.warning("the zygote is gone: starting another")
                self.start()
            wanted = import_settings(env)
            if wanted != self.import_env:
                differ = sorted(k for k in {*wanted, *self.import_env}
                                if wanted.get(k) != self.import_env.get(k))
                raise WarmStartError(f"its environment differs from the zygote's in "
                                     f"{', '.join(differ)}, which are read at import time")
            channel = self._channel
            assert channel is not None
            with self.changed:
                self._next_id += 1
                request_id = self._next_id
            try:
                send(channel, {"id": request_id, "module": argv[2], "args": argv[3:],
                               "env": env, "cwd": os.getcwd(), "log": str(log_path),
                               "title": " ".join(argv)})
            except OSError as error:
                raise WarmStartError(f"the zygote is gone ({error})") from None
            deadline = time.monotonic() + self.answer_timeout_s
            with self.changed:
                self.changed.wait_for(lambda: request_id in self._answers or not self.alive(),
                                      max(0.0, deadline - time.monotonic()))
                answer = self._answers.pop(request_id, None)
            if isinstance(answer, WarmProcess):
                answer.args = argv
                return answer
            if answer is None:
                raise WarmStartError(
                    "the zygote died" if not self.alive() else
                    f"the zygote did not answer within {self.answer_timeout_s:g} s")
            raise WarmStartError(answer)
