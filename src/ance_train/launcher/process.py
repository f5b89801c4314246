"""Child-process hygiene for the embedded mode: children die with their parent."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for Popen: the kernel sends SIGTERM to the child if the parent dies,
    even by SIGKILL, so a killed launcher leaves no orphan service behind (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
