"""Command-line options of issue 30: ``--version``, ``--set`` and the no-op warnings of
``ance-train validate`` / ``run``, through the real ``ance-train`` process."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from ance_train_dev.helpers import write_config


def ance(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ance_train.cli", *args], capture_output=True,
                          text=True, timeout=120)


def _config(tmp_path: Path, data: Path, model: Path) -> Path:
    return write_config(tmp_path / "c.yaml", run_id="options", output_dir=str(tmp_path / "runs"),
                        data={"path": str(data)},
                        model={"path": str(model), "max_query_length": 16, "max_doc_length": 32},
                        negatives={"pool": "ann", "warmup": "none"})


def test_version_prints_the_installed_package_version() -> None:
    result = ance("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"ance-train {version('ance-train')}"


def test_validate_applies_set_and_warns_of_no_op_settings(tmp_path: Path, scifact_subset,
                                                          tiny_model) -> None:
    config = _config(tmp_path, scifact_subset, tiny_model)
    quiet = ance("validate", "--config", str(config))
    assert quiet.returncode == 0, quiet.stderr
    assert "warning: negatives" not in quiet.stderr
    warned = ance("validate", "--config", str(config), "--set", "negatives.per_query=0")
    assert warned.returncode == 0, warned.stderr
    assert "warning: negatives.per_query is 0" in warned.stderr
    assert "mines an ANN negatives table at every refresh" in warned.stderr


def test_run_set_is_validated_before_anything_starts(tmp_path: Path, scifact_subset,
                                                     tiny_model) -> None:
    config = _config(tmp_path, scifact_subset, tiny_model)
    result = ance("run", "--config", str(config), "--set", "training.steps=20",
                  "--set", "training.refresh_evry=5")
    assert result.returncode == 2
    assert "training.refresh_evry: unknown field (did you mean training.refresh_every?)" in (
        result.stderr)
    assert str(config) in result.stderr
    result = ance("run", "--config", str(config), "--set", "training.steps=0")
    assert result.returncode == 2 and "training.steps" in result.stderr
    assert not (tmp_path / "runs").exists()
