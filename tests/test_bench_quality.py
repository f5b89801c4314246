"""`bench/quality.py` end to end on a tiny model: keeps the benchmark command working."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import REPO


def test_quality_benchmark_runs_and_reports(tmp_path: Path, scifact_subset, tiny_model) -> None:
    """Two invocations (as the cpu profile is run: a few methods each) merged by --combine."""
    out = tmp_path / "out"
    common = [sys.executable, str(REPO / "bench" / "quality.py"), "--profile", "cpu",
              "--seeds", "7", "--data", str(scifact_subset), "--model", str(tiny_model),
              "--steps", "6", "--refresh-every", "3", "--max-doc-length", "32",
              "--set", "training.learning_rate=3e-5", "--runs-dir", str(tmp_path / "runs"),
              "--out", str(out)]
    for method in ("in-batch", "ance"):
        result = subprocess.run([*common, "--methods", method, "--name", f"part-{method}.v1"],
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "quality.py"), "--profile", "cpu", "--out",
         str(out), "--combine", str(out / "part-in-batch.v1.json"), str(out / "part-ance.v1.json")],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "quality-cpu.json").read_text())
    assert report["methods"] == ["in-batch", "ance"] and report["seeds"] == [7]
    assert set(report["aggregate"]) == {"in-batch", "ance"}
    assert [part["methods"] for part in report["parts"]] == [["in-batch"], ["ance"]]
    assert report["overrides"] == ["training.learning_rate=3e-5"]
    bm25 = report["references"]["BM25 (bm25s k1=0.9 b=0.4)"]
    zero_shot = report["references"]["zero-shot (no training)"]
    for ref in (bm25, zero_shot):
        assert 0.0 <= ref["test"]["ndcg@10"] <= 1.0 and 0.0 <= ref["dev"]["ndcg@10"] <= 1.0
    assert bm25["test"]["ndcg@10"] > 0.3, "BM25 on this SciFact subset is far from random"
    for run in report["runs"]:
        steps = [r["step"] for r in run["refreshes"]]
        assert steps[0] == 0 and steps[-1] == 6 and run["selected_step"] in steps
        best_dev = max(r["metrics"]["dev"]["ndcg@10"] for r in run["refreshes"])
        assert run["dev"]["ndcg@10"] == best_dev, "selection must be on dev"
        selected = next(r for r in run["refreshes"] if r["step"] == run["selected_step"])
        assert run["test"] == selected["metrics"]["test"]
        assert run["config"]["training"]["seed"] == 7
        assert run["config"]["training"]["learning_rate"] == 3e-5
        assert run["refreshes"][0]["metrics"] == report["runs"][0]["refreshes"][0]["metrics"], \
            "checkpoint 0 is the same pretrained model for every method"
    assert [r["method"] for r in report["runs"]] == ["in-batch", "ance"]
    markdown = (out / "quality-cpu.md").read_text()
    assert "| ance |" in markdown and "| in-batch |" in markdown and "reference" in markdown
    assert report["command"] in markdown
    for plot in report["plots"]:
        data = (out / plot).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
