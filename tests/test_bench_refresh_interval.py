"""`bench/refresh_interval.py` (issue 31, item 3): a unit test about logic, no runs.

Synthetic `bench/quality.py` reports, written to tmp_path, stand in for the real ones: the
staleness of a hand-made swaps list, the grouping by refresh interval and the paired
differences, the refusal of reports whose budgets differ in more than the interval, the
decision rule both ways, and the written report.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ance_train_dev import refresh_interval
from ance_train_dev.helpers import REPO

STEPS = 60
SEEDS = (13, 42, 77)


def config(interval: int, seed: int, runs_dir: str = "/runs/x") -> dict:
    """A run config as bench/quality.py writes it for the quickstart budget."""
    return {"run_id": f"ance-s{seed}", "output_dir": runs_dir,
            "data": {"format": "beir", "path": "/data/scifact", "dev_fraction": 0.1},
            "model": {"pooling": "mean", "similarity": "cosine", "temperature": 0.05,
                      "max_query_length": 64, "max_doc_length": 128},
            "training": {"steps": STEPS, "batch_size": 16, "learning_rate": 5e-5,
                         "warmup_steps": 6, "refresh_every": interval, "torch_threads": 1,
                         "seed": seed, "torch_threads_between_refreshes": 2},
            "inference": {"replicas": 2, "shard_size": 500, "batch_size": 32,
                          "claim_timeout_s": 120, "torch_threads": 1},
            "index": {"eval_splits": ["dev", "test"]},
            "negatives": {"pool": "ann", "sampling": "uniform", "per_query": 1, "top_k": 20,
                          "warmup": "bm25", "warmup_steps": min(interval, STEPS - 1)}}


def metrics(dev: float, test: float) -> dict:
    return {"dev": {"ndcg@10": dev, "mrr@10": dev - 0.03},
            "test": {"ndcg@10": test, "mrr@10": test - 0.03}}


def run(interval: int, seed: int, dev_final: float, dev_best: float | None = None,
        method: str = "ance") -> dict:
    """A run whose dev curve rises to ``dev_best`` at the last-but-one checkpoint (if given,
    else peaks at the end) and ends at ``dev_final``; test = dev + 0.01."""
    steps = list(range(0, STEPS + 1, interval))
    curve = {step: 0.60 + 0.001 * step / interval for step in steps}
    curve[STEPS] = dev_final
    if dev_best is not None:
        curve[steps[-2]] = dev_best
    refreshes = [{"step": s, "metrics": metrics(v, v + 0.01), "diagnostics": {}}
                 for s, v in curve.items()]
    selected = max(refreshes, key=lambda r: (r["metrics"]["dev"]["ndcg@10"], -r["step"]))
    swaps = [{"negatives_step": -1, "step": 1}] + [
        {"negatives_step": s, "step": s + interval // 2 + 1} for s in steps[:-1] if s > 0] + [
        {"negatives_step": 0, "step": interval + 1}]
    return {"method": method, "seed": seed, "minutes": 5.0 + interval / 10,
            "selected_step": selected["step"], "dev": selected["metrics"]["dev"],
            "test": selected["metrics"]["test"], "refreshes": refreshes, "swaps": swaps,
            "losses": [1.0] * STEPS, "config": config(interval, seed, f"/runs/r{interval}")}


def write(path: Path, runs: list[dict], date: str = "2026-12-01T00:00:00+00:00") -> Path:
    path.write_text(json.dumps({
        "command": f"python bench/quality.py --refresh-every "
                   f"{runs[0]['config']['training']['refresh_every']}",
        "date": date, "runs": runs,
        "machine": {"cpu": "Test CPU", "cores": 2, "cpu_flags": ["avx2"], "gpu": None,
                    "torch": "2.x"}}))
    return path


def reports(tmp_path: Path, finals: dict[int, list[float]],
            bests: dict[int, list[float | None]] | None = None) -> list[Path]:
    bests = bests or {}
    return [write(tmp_path / f"refresh-every-{interval}.json",
                  [run(interval, seed, final, (bests.get(interval) or [None] * 3)[i])
                   for i, (seed, final) in enumerate(zip(SEEDS, values, strict=True))])
            for interval, values in finals.items()]


def summarise(paths: list[Path], baseline: int = 20) -> dict:
    return refresh_interval.summarise(paths, baseline)


def test_staleness_of_a_hand_made_swaps_list() -> None:
    # BM25 for steps 1-20, then negatives of checkpoint 0 (steps 21-29: lags 21..29),
    # of 20 (steps 30-48: lags 10..28) and of 40 (steps 49-60: lags 9..20); listed unsorted.
    swaps = [{"negatives_step": 20, "step": 30}, {"negatives_step": -1, "step": 1},
             {"negatives_step": 40, "step": 49}, {"negatives_step": 0, "step": 21}]
    stale = refresh_interval.staleness(swaps, 60)
    assert stale["warmup_steps"] == 20 and stale["ann_steps"] == 40
    assert stale["mean"] == pytest.approx((225 + 361 + 174) / 40)  # = 19.0
    assert stale["negatives_steps"] == [0, 20, 40]
    # No table yet at the start (ANCE-Tele style first swap at 3): steps 1-2 are warm-up.
    stale = refresh_interval.staleness([{"negatives_step": 0, "step": 3}], 4)
    assert stale == {"mean": pytest.approx(3.5), "ann_steps": 2, "warmup_steps": 2,
                     "negatives_steps": [0]}
    # A swap after the last step was never trained on; no swap at all: all warm-up.
    assert refresh_interval.staleness(
        [{"negatives_step": -1, "step": 1}, {"negatives_step": 40, "step": 61}],
        60)["negatives_steps"] == []
    assert refresh_interval.staleness([], 5) == {"mean": None, "ann_steps": 0,
                                                 "warmup_steps": 5, "negatives_steps": []}


def test_runs_are_grouped_by_interval_and_paired_by_seed(tmp_path: Path) -> None:
    paths = reports(tmp_path, {20: [0.68, 0.69, 0.70], 10: [0.70, 0.68, 0.73]})
    report = summarise(paths)
    by_interval = {e["refresh_every"]: e for e in report["intervals"]}
    assert sorted(by_interval) == [10, 20]
    ten = by_interval[10]
    assert ten["seeds"] == list(SEEDS) and ten["files"] == [str(paths[1])]
    assert [r["dev_final"] for r in ten["runs"]] == [0.70, 0.68, 0.73]
    assert ten["stats"]["dev_final"]["mean"] == pytest.approx(0.70333333)
    assert ten["stats"]["test_final"]["mean"] == pytest.approx(0.71333333)
    first = ten["runs"][0]
    assert first["checkpoints_evaluated"] == 7  # 0, 10, ..., 60
    assert first["negatives_steps"] == [0, 10, 20, 30, 40, 50]
    assert first["warmup_steps"] == 10
    assert by_interval[20]["runs"][0]["checkpoints_evaluated"] == 4
    (pair,) = report["paired"]
    assert pair["refresh_every"] == 10 and pair["baseline"] == 20
    final = pair["final"]
    assert final["per_seed"] == pytest.approx({"13": 0.02, "42": -0.01, "77": 0.03})
    assert final["mean"] == pytest.approx(0.04 / 3)
    assert (final["min"], final["max"]) == (pytest.approx(-0.01), pytest.approx(0.03))
    # The last checkpoint is each run's best here, so selected = final.
    assert pair["selected"]["per_seed"] == pytest.approx(final["per_seed"])
    # The other interval as baseline: the signs turn.
    assert summarise(paths, 10)["paired"][0]["final"]["mean"] == pytest.approx(-0.04 / 3)


def test_selected_and_final_checkpoints_differ(tmp_path: Path) -> None:
    paths = reports(tmp_path, {20: [0.68, 0.69, 0.70], 10: [0.66, 0.66, 0.66]},
                    bests={10: [0.71, 0.72, 0.73]})
    report = summarise(paths)
    ten = next(e for e in report["intervals"] if e["refresh_every"] == 10)
    assert [r["selected_step"] for r in ten["runs"]] == [50, 50, 50]
    assert [r["dev_selected"] for r in ten["runs"]] == [0.71, 0.72, 0.73]
    (pair,) = report["paired"]
    assert pair["selected"]["per_seed"] == pytest.approx({"13": 0.03, "42": 0.03, "77": 0.03})
    assert pair["final"]["per_seed"] == pytest.approx({"13": -0.02, "42": -0.03, "77": -0.04})


@pytest.mark.parametrize("change, field", [
    (lambda r: r["config"]["training"].__setitem__("batch_size", 32), "training.batch_size"),
    (lambda r: r["config"]["model"].__setitem__("max_query_length", 48),
     "model.max_query_length"),
    (lambda r: r["config"]["negatives"].__setitem__("warmup_steps", 5),
     "negatives.warmup_steps"),
    (lambda r: r["config"]["training"].pop("torch_threads_between_refreshes"),
     "training.torch_threads_between_refreshes"),
    (lambda r: r["config"]["data"].__setitem__("path", "/data/nfcorpus"), "data.path"),
    (lambda r: r.__setitem__("method", "simans"), "method"),
])
def test_reports_of_another_budget_are_refused_naming_the_file(tmp_path: Path, change,
                                                               field: str) -> None:
    baseline, other = reports(tmp_path, {20: [0.68, 0.69, 0.70], 10: [0.70, 0.70, 0.70]})
    data = json.loads(other.read_text())
    change(data["runs"][1])
    other.write_text(json.dumps(data))
    with pytest.raises(SystemExit) as stopped:
        summarise([baseline, other])
    message = str(stopped.value)
    assert message.startswith(f"{other}: run ") and "seed 42" in message
    assert field in message and str(baseline) in message


def test_what_follows_the_interval_is_accepted() -> None:
    """Another runs directory, run id and seed, and the BM25 warm-up of one interval
    (bench/quality.py derives negatives.warmup_steps from --refresh-every) are no budget."""
    assert (refresh_interval.budget_of(config(10, 13, "/a"))
            == refresh_interval.budget_of(config(20, 77, "/b")))
    changed = copy.deepcopy(config(10, 13))
    changed["run_id"] = "other"
    assert refresh_interval.budget_of(changed) == refresh_interval.budget_of(config(10, 13))


def test_seeds_must_match_and_pair_once(tmp_path: Path) -> None:
    baseline, other = reports(tmp_path, {20: [0.68, 0.69, 0.70], 10: [0.70, 0.70, 0.70]})
    data = json.loads(other.read_text())
    data["runs"] = data["runs"][:2]
    other.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match=r"refresh-every-10\.json: seed values \[13, 42\]"):
        summarise([baseline, other])
    with pytest.raises(SystemExit, match="each interval and seed once"):
        summarise([baseline, baseline])
    with pytest.raises(SystemExit, match="--baseline 30: no report"):
        summarise([baseline], 30)


def test_a_run_without_its_final_evaluation_is_refused(tmp_path: Path) -> None:
    baseline, other = reports(tmp_path, {20: [0.68, 0.69, 0.70], 10: [0.70, 0.70, 0.70]})
    data = json.loads(other.read_text())
    data["runs"][2]["refreshes"].pop()
    other.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match=r"refresh-every-10\.json: run ance seed 77: no "
                                         r"evaluation at the final step 60"):
        summarise([baseline, other])


def test_a_winner_that_gains_on_every_seed_becomes_the_default(tmp_path: Path) -> None:
    paths = reports(tmp_path, {20: [0.68, 0.69, 0.70], 10: [0.69, 0.70, 0.71],
                               30: [0.66, 0.69, 0.69]})
    decision = summarise(paths)["decision"]
    assert decision["winner_by_mean"] == 10 and decision["default"] == 10
    assert decision["changed"] is True
    assert "becomes the default" in decision["reason"]


def test_a_winner_on_the_mean_only_leaves_the_baseline(tmp_path: Path) -> None:
    # refresh_every 10: higher mean (+0.02) but one seed lower (-0.01).
    paths = reports(tmp_path, {20: [0.68, 0.69, 0.70], 10: [0.72, 0.68, 0.73]})
    decision = summarise(paths)["decision"]
    assert decision["winner_by_mean"] == 10 and decision["default"] == 20
    assert decision["changed"] is False
    assert "not separable from noise at 3 seeds" in decision["reason"]
    # The baseline itself best on the mean: it stays, whatever the seeds.
    paths = reports(tmp_path, {20: [0.70, 0.70, 0.70], 10: [0.71, 0.69, 0.68]})
    decision = summarise(paths)["decision"]
    assert decision["winner_by_mean"] == 20 and decision["default"] == 20


def test_the_entry_point_writes_json_and_markdown_with_the_command(tmp_path: Path) -> None:
    paths = reports(tmp_path, {20: [0.68, 0.69, 0.70], 10: [0.69, 0.70, 0.71]})
    out = tmp_path / "out"
    command = [sys.executable, str(REPO / "bench" / "refresh_interval.py"), *map(str, paths),
               "--baseline", "20", "--out", str(out), "--name", "interval"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "interval.json").read_text())
    markdown = (out / "interval.md").read_text()
    assert "bench/refresh_interval.py" in report["command"] and "--baseline 20" in \
        report["command"]
    assert f"Command: `{report['command']}`" in markdown
    assert [r["date"] for r in report["reports"]] == ["2026-12-01T00:00:00+00:00"] * 2
    assert report["reports"][0]["machine"]["cpu"] == "Test CPU" and "Test CPU" in markdown
    assert "## refresh_every 20 (baseline)" in markdown and "## refresh_every 10" in markdown
    assert "| 10 | selected | +0.0100 | +0.0100 | +0.0100 |" in markdown
    assert f"**Decision: {report['decision']['reason']}.**" in markdown
    assert "refresh_every 10 has the highest mean" in markdown
    assert markdown in done.stdout  # and on stdout
