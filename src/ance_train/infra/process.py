"""Process hygiene: children die with their parent (the embedded mode's services, torchrun's
trainer ranks), and a process asked to stop ends within a grace period."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time

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
