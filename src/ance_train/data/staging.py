"""Writing a dataset directory all at once: into a hidden sibling first, renamed into place
only when complete, so a failure (or Ctrl-C) never leaves a half-written dataset behind.
Used by ``ance-train data get`` and ``ance-train data convert``."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ance_train.data.problems import DataError


def check_target(target: Path) -> None:
    """Refuse a ``target`` that is a file or a non-empty directory (never overwritten)."""
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise DataError(f"{target} exists and is not a directory: choose another --to")
    if target.is_dir() and any(target.iterdir()):
        raise DataError(f"{target} is not empty: remove it or choose another --to "
                        "(a dataset is never written over another)")


@contextmanager
def staged_directory(target: Path) -> Iterator[Path]:
    """A fresh directory beside ``target`` to write the dataset into; on a clean exit it
    becomes ``target`` (an empty ``target`` directory is replaced), on any exception it is
    removed. ``target`` is checked with :func:`check_target` first and again at the end."""
    target = Path(target)
    check_target(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        yield staging
        check_target(target)  # nobody wrote there meanwhile
        if target.is_dir():
            target.rmdir()
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
