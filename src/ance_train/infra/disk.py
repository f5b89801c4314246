"""Refuse early what would fail late: free disk checked before work that needs it.

A run whose store fills the disk half-way fails mid-refresh with ``ENOSPC`` after hours of
work; the same numbers ``ance-train plan`` predicts say so before the run starts
(:func:`ance_train.index.capacity.run_store_bytes`), and the trainer checks before each
checkpoint it writes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, Protocol


class DiskUsage(NamedTuple):
    total: int
    used: int
    free: int


class _FreeBytes(Protocol):
    """What a ``disk_usage`` function returns, as far as it is read here: :class:`DiskUsage`
    or :func:`shutil.disk_usage`'s own named tuple."""

    @property
    def free(self) -> int: ...


DiskUsageFn = Callable[[str], _FreeBytes]


class InsufficientDisk(OSError):
    """Less free disk than the work needs; the message names the path, both sizes and the
    setting to change."""


def size(num_bytes: float) -> str:
    """Decimal units, as ``ance-train plan`` prints them."""
    if num_bytes >= 1e9:
        return f"{num_bytes / 1e9:,.2f} GB"
    return f"{num_bytes / 1e6:.1f} MB"


def existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest existing parent (where a directory to be created will live)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when absent)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def check_free(path: Path, needed: int, what: str, hint: str, reclaimable: int = 0,
               disk_usage: DiskUsageFn = shutil.disk_usage) -> int:
    """Raise :class:`InsufficientDisk` unless the filesystem of ``path`` has ``needed`` bytes
    free (counting ``reclaimable`` bytes that will be deleted first); return the free bytes.
    ``disk_usage`` is injectable for tests: no real disk can be filled on demand."""
    where = existing_ancestor(path)
    free = int(disk_usage(str(where)).free) + reclaimable
    if free < needed:
        raise InsufficientDisk(
            f"not enough free disk for {what} at {path}: needs about {size(needed)}, "
            f"{size(free)} free on the filesystem of {where}"
            + (f" (counting {size(reclaimable)} of the run being replaced)"
               if reclaimable else "")
            + f". {hint}")
    return free
