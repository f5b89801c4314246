"""What a service process imports before its work: the indexer needs no torch and no
transformers unless it serves a text query (each costs about a second of every start, and the
services start again on every restart), yet the log settings still reach transformers when a
service imports it later. Each check runs in a fresh interpreter: this one has both already."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)


def run_python(script: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def test_indexer_and_its_logging_import_neither_torch_nor_transformers() -> None:
    imported = run_python(
        "import sys\n"
        "import ance_train.indexer.indexer\n"
        "from ance_train.runtime import setup_logging\n"
        "setup_logging('indexer', 'indexer-0')\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n")
    assert imported == ["False", "False"]


@pytest.mark.parametrize("transformers_first", [False, True])
def test_progress_bars_are_off_whether_transformers_comes_before_or_after(
        transformers_first: bool) -> None:
    before = "import transformers\n" if transformers_first else ""
    enabled = run_python(
        f"{before}"
        "from ance_train.runtime import setup_logging\n"
        "setup_logging('trainer', 'trainer')\n"
        "from huggingface_hub.utils import are_progress_bars_disabled\n"
        "from transformers.utils import logging\n"
        "print(logging.is_progress_bar_enabled(), are_progress_bars_disabled())\n")
    assert enabled == ["False", "True"]
