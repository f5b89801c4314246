"""Pick a loopback TCP port for a child process to listen on (embedded runs and tests).

The usual trick, bind port 0 and close, hands back a port from the kernel's *ephemeral*
range. Between closing it and the child binding it, any outgoing connection on the machine
(a Redis client, an S3 request, gRPC) may be given that same port as its local end, and the
child then fails with "Address already in use". A CI run lost a service's metrics port that
way. Ports below the ephemeral range are never handed to outgoing connections, so a port
picked at random there can only be lost to another explicit bind to that very number. A
process never hands out the same port twice (the launcher picks every service's ports
before any of them binds), so its own picks cannot collide either.

Separate processes that pick at the same time (parallel test workers, each starting servers
and ``ance-train run`` launchers) can still pick the same number and both find it free. Give
each one its own slice with ``ANCE_PORT_RANGE=LOW-HIGH`` (ports LOW to HIGH-1, inherited by
child processes; tests/conftest.py sets one per pytest-xdist worker): picks then come from
that slice only, and the kernel assigns a port only when the slice has none free.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_LOW = 32768  # Linux's default when /proc is not readable
LOWEST_PICKED_PORT = 10000  # leave well-known and registered service ports alone
PORT_RANGE_ENV = "ANCE_PORT_RANGE"
_ATTEMPTS = 200
_handed_out: set[int] = set()  # ports this process returned before


def ephemeral_port_low() -> int:
    """The lowest port the kernel may assign to an outgoing connection."""
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def picked_range() -> tuple[int, int] | None:
    """``(low, high)``: picks come from ports low to high-1; None when there is too little
    room below the ephemeral range (the kernel picks then).

    ``ANCE_PORT_RANGE`` ("LOW-HIGH") sets the range; a malformed value is an error, never
    silently ignored (two processes could then pick from the same ports again).
    """
    value = os.environ.get(PORT_RANGE_ENV, "").strip()
    if value:
        try:
            low, high = (int(part) for part in value.split("-"))
        except ValueError:
            raise ValueError(f"{PORT_RANGE_ENV}={value!r}: expected LOW-HIGH, e.g. 10000-20000"
                             ) from None
        if not 1 <= low < high <= 65536:
            raise ValueError(f"{PORT_RANGE_ENV}={value!r}: expected 1 <= LOW < HIGH <= 65536")
        return low, high
    high = ephemeral_port_low()
    return (LOWEST_PICKED_PORT, high) if high - LOWEST_PICKED_PORT >= 1000 else None


def _try_bind(port: int) -> int | None:
    """Bind 127.0.0.1:``port`` (0: the kernel picks) and release it: the port, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return None
        return int(sock.getsockname()[1])


def free_port() -> int:
    """Return a port on 127.0.0.1 that is free now and outside the ephemeral range (inside
    ``ANCE_PORT_RANGE`` when that is set).

    Falls back to a kernel-assigned port when the ephemeral range leaves no room below it, or
    no port of the range was free.
    """
    span = picked_range()
    picks = ((random.randrange(*span) for _ in range(_ATTEMPTS)) if span is not None else ())
    for candidate in itertools.chain(picks, itertools.repeat(0, _ATTEMPTS)):
        if candidate in _handed_out:
            continue
        port = _try_bind(candidate)
        if port is not None and port not in _handed_out:
            _handed_out.add(port)
            return port
    raise OSError("no free loopback port that this process has not handed out already")
