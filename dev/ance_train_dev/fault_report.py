"""Fault-injection tests record what they did here, so that ``bench/reliability.py`` can
turn a run of the tests into the fault matrix of ``docs/reliability.md``.

Recording is off unless ``ANCE_FAULT_REPORT`` names a JSON-lines file; the assertions of a
test never depend on it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def record_fault(fault: str, injection: str, outcome: str, recovery_s: float | None,
                 lost: str = "nothing", **details: object) -> None:
    """Append one row of the fault matrix (called after the test's assertions passed)."""
    target = os.environ.get("ANCE_FAULT_REPORT")
    if not target:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]  # set by pytest
    row = {"fault": fault, "injection": injection, "outcome": outcome,
           "recovery_s": None if recovery_s is None else round(recovery_s, 2), "lost": lost,
           "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "test": test,
           **details}
    with Path(target).open("a") as handle:
        handle.write(json.dumps(row) + "\n")
