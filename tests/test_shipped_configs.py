"""The configurations shipped in configs/: they load, and the methods share one budget."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from ance_train.config import load_config

from ance_train_dev.helpers import REPO

CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))
METHODS = sorted((REPO / "configs" / "methods").glob("*.yaml"))


def test_there_are_configs_to_check() -> None:
    assert REPO / "configs" / "quickstart.yaml" in CONFIGS
    assert len(METHODS) >= 8


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_shipped_config_loads_and_finds_its_dataset(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="ance_train.config"):
        config = load_config(path)
    assert (Path(config.data.path) / "corpus.jsonl").is_file(), config.data.path
    assert not caplog.records, f"deprecated keys in {path}: {caplog.text}"


def test_every_method_has_the_same_budget() -> None:
    """The quality benchmark compares methods at one budget: only negatives may differ."""
    raws = {path.stem: yaml.safe_load(path.read_text()) for path in METHODS}
    for name, raw in raws.items():
        assert raw["run_id"] == name
        assert set(raw) <= {"run_id", "output_dir", "data", "model", "training", "inference",
                            "index", "negatives"}, name
    reference = raws["ance"]
    for name, raw in raws.items():
        for section in ("data", "model", "training", "inference", "index"):
            assert raw.get(section) == reference.get(section), f"{name}: {section}"
