"""scripts/quickstart.sh's arguments: a config, then options passed on to `ance-train run`
(README: `bash scripts/quickstart.sh --set training.steps=40`, the shorter first run).

A unit test about the script's logic: setup.sh and ance-train are stand-ins that record what
they were given (the real run is README's quickstart, timed in docs/results.md)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def quickstart(tmp_path: Path, *args: str, scifact: Path | None = None) -> list[str]:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "quickstart.sh", repo / "scripts" / "quickstart.sh")
    (repo / "scripts" / "setup.sh").write_text("exit 0\n")
    bin_dir = repo / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'PATH="{bin_dir}:$PATH"\n')
    record = tmp_path / "argv"
    stand_in = bin_dir / "ance-train"
    stand_in.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "{record}"\n')
    stand_in.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin"}
    if scifact is not None:
        env["ANCE_SCIFACT_DIR"] = str(scifact)
    done = subprocess.run(["bash", "scripts/quickstart.sh", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return record.read_text().splitlines()


def test_options_go_on_to_the_run_after_the_data_path(tmp_path: Path):
    scifact = tmp_path / "scifact"
    scifact.mkdir()
    argv = quickstart(tmp_path, "--set", "training.steps=40", scifact=scifact)
    assert argv == ["run", "--config", "configs/quickstart.yaml", "--overwrite",
                    "--set", f"data.path={scifact}", "--set", "training.steps=40"]


def test_a_config_first_then_options(tmp_path: Path):
    argv = quickstart(tmp_path, "configs/methods/simans.yaml", "--set", "training.steps=8")
    assert argv == ["run", "--config", "configs/methods/simans.yaml", "--overwrite",
                    "--set", "training.steps=8"]
