"""The dev harness, never shipped in the wheel: what tests/ and bench/ share.

Test support (synthetic corpora and vectors, the tiny random BERT, the SciFact subset, service
harnesses and stand-ins) and the benchmarks' libraries (reports, stored runs, the quality and
chaos benchmarks' code). Installed editable by ``scripts/setup.sh`` (``pip install -e ./dev``);
data files stay in the repository (``tests/fixtures/``), found from ``REPO``.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
