"""Child-process hygiene: children die with their parent (the embedded mode's services,
torchrun's trainer ranks)."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """``preexec_fn`` for Popen: the kernel sends ``sig`` to the child if the parent dies,
    even by SIGKILL, so a killed launcher leaves no orphan service behind (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        pass
