"""Atomic file writes: a reader sees the old file or the whole new one, never a partial one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, TypeVar

T = TypeVar("T")


def atomic_write(path: Path, write: Callable[[IO[bytes]], T], suffix: str = ".tmp") -> T:
    """Write through ``write(handle)`` to a temp file beside ``path``, fsync, then rename.

    Returns what ``write`` returned. If ``write`` raises (a download that fails its checksum,
    say), the temp file is removed and ``path`` keeps its old content.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as handle:
            result = write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return result
