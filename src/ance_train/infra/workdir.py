"""One service process per work directory.

A service keeps what it downloads and writes (the dataset's index, checkpoints, embeddings,
negatives tables) under its work directory, and replaces and prunes those files as it goes.
Two processes sharing one would list, overwrite and delete each other's files mid-use: a
trainer publishing checkpoint N found, in its own checkpoint folder, an inferencer's
half-downloaded copy of that checkpoint (the chart's pods, when every pod's ``/work``
emptyDir was played as the same volume). So each service claims its directory at start and
a second one is refused, naming the directory and the process holding it.

The claim is a POSIX record lock (``fcntl.lockf``) on a file in the directory: the kernel
drops it when the process dies, however it dies, and a forked child (a DataLoader worker)
does not inherit it, so a restarted service never waits on the one it replaces.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

LOCK_FILE = ".ance-work.lock"

# Held for the life of the process: closing any descriptor of the file would drop the lock.
_claimed: dict[Path, int] = {}


class WorkDirInUse(RuntimeError):
    """Another live process holds the work directory."""


def claim_work_dir(directory: Path, role: str) -> Path:
    """Create ``directory`` and hold it for this process (again in the same process: a
    no-op). Raises :class:`WorkDirInUse` when another process holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    resolved = directory.resolve()
    if resolved in _claimed:
        return resolved
    fd = os.open(resolved / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "unknown"
        os.close(fd)
        if error.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        raise WorkDirInUse(
            f"work directory {resolved} is in use by another ance-train process ({holder}): "
            f"give each service process its own --work-dir (ANCE_WORK_DIR)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{role}, pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    _claimed[resolved] = fd
    return resolved
