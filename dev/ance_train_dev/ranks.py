"""A trainer rank's process under torchrun (tests/test_rank_failure.py, bench/chaos.py)."""

from __future__ import annotations

import psutil


def rank_process(torchrun_pid: int, rank: int) -> psutil.Process | None:
    """The worker that torchrun (``torchrun_pid``) started as ``rank``: its ``RANK`` variable."""
    try:
        workers = psutil.Process(torchrun_pid).children(recursive=True)
    except psutil.Error:  # torchrun gone
        return None
    for worker in workers:
        try:
            if worker.environ().get("RANK") == str(rank):
                return worker
        except psutil.Error:  # exited meanwhile
            continue
    return None
