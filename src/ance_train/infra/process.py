"""Process hygiene: children die with their parent (the embedded mode's services, torchrun's
trainer ranks), a process asked to stop ends within a grace period, and a finished process
ends without tearing down every module it imported."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from typing import NoReturn

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """``preexec_fn`` for Popen: the kernel sends ``sig`` to the child if the parent dies,
    even by SIGKILL, so a killed launcher leaves no orphan service behind (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        pass


# Seconds a service may take to stop after SIGTERM before it ends itself: Kubernetes' default
# terminationGracePeriodSeconds, after which the kubelet would SIGKILL it.
TERMINATION_GRACE_VAR = "ANCE_TERMINATION_GRACE_S"
DEFAULT_TERMINATION_GRACE_S = 30.0


def termination_grace_s() -> float:
    """``ANCE_TERMINATION_GRACE_S`` (seconds, > 0), else :data:`DEFAULT_TERMINATION_GRACE_S`."""
    raw = os.environ.get(TERMINATION_GRACE_VAR)
    if raw is None:
        return DEFAULT_TERMINATION_GRACE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TERMINATION_GRACE_VAR}={raw!r}: expected seconds > 0")
    return value


def exit_after_grace(log: logging.Logger, grace_s: float, code: int) -> threading.Thread:
    """End this process with ``code`` if it still runs ``grace_s`` from now.

    A stop request normally ends a service in moments. Where nothing else would kill it, a
    service whose stop waits on a dependency that is gone (Redis and the store died with an
    embedded launcher that was killed, and PDEATHSIG asked the service to stop) would retry
    for minutes as an orphan: this is the kubelet's SIGKILL after the grace period, from
    inside. Returns the (daemon) watchdog thread."""

    def expire() -> None:
        time.sleep(grace_s)
        log.error("still running %.3gs after the request to stop (a dependency gone?): "
                  "exiting", grace_s)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(code)

    watchdog = threading.Thread(target=expire, name="termination-grace", daemon=True)
    watchdog.start()
    return watchdog


def exit_code(code: object) -> int:
    """The exit status ``sys.exit(code)`` gives: None is 0, an int is itself, anything else
    is printed to stderr and gives 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def exit_without_teardown(code: object, join_s: float = 1.0) -> NoReturn:
    """End the process as ``sys.exit(code)`` would, without the interpreter's teardown.

    Once torch and transformers are imported (about 3,000 modules), Python's own exit spends
    about 1 s, and 1.2 CPU-s, freeing them: measured on a 2-core EPYC after importing
    ``transformers.models.bert.modeling_bert`` (4.9 CPU-s with the teardown, 3.6 without).
    Every stopping service and every end-to-end test waited for it. What an exit must do is
    still done here, in the interpreter's order:
    the non-daemon threads are joined, the ``atexit`` hooks run (logging's flush among them),
    the standard streams are flushed; then ``os._exit``.
    A non-daemon thread still alive after ``join_s`` (an executor nobody shut down, which
    only the interpreter's own exit knows how to stop) gets the ordinary ``sys.exit``."""
    status = exit_code(code)
    deadline = time.monotonic() + join_s
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() and not t.daemon and t is not threading.main_thread()
           for t in threading.enumerate()):
        sys.exit(status)
    atexit._run_exitfuncs()  # what Py_FinalizeEx runs first; the rest is freeing memory
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or broken: nothing to write
            stream.flush()
    os._exit(status)
