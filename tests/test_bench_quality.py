"""`bench/quality.py` end to end on a tiny model: keeps the benchmark command working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from ance_train.launcher import ports

# The analyses run in this process (their CLIs' own main): a subprocess each spent 5-15 s of a
# loaded CI machine importing scipy and torch again.
from ance_train_dev import negative_hardness
from ance_train_dev import significance as significance_cli
from ance_train_dev.helpers import REPO
from ance_train_dev.servers import worker_port_range


def test_quality_benchmark_runs_and_reports(tmp_path: Path, scifact_subset, tiny_model) -> None:
    """Three invocations merged by --combine, as the cpu profile is run: a few methods each,
    then more seeds of some methods."""
    out = tmp_path / "out"
    common = [sys.executable, str(REPO / "bench" / "quality.py"), "--profile", "cpu",
              "--data", str(scifact_subset), "--model", str(tiny_model),
              "--steps", "6", "--refresh-every", "3", "--max-doc-length", "32",
              "--set", "training.learning_rate=3e-5", "--set", "inference.replicas=1",
              "--runs-dir", str(tmp_path / "runs"),
              "--out", str(out)]
    parts = [("in-batch", "7"), ("ance", "7"), ("in-batch", "8")]
    # The parts share nothing (own runs, own output names): they run side by side, each
    # picking its ports from its own share of this process's range.
    spans = [worker_port_range(ports.picked_range(), i, len(parts)) for i in range(len(parts))]
    running = []
    for (method, seed), span in zip(parts, spans, strict=True):
        name = f"part-{method}-{seed}.v1"
        env = dict(os.environ)
        if span is not None:
            env[ports.PORT_RANGE_ENV] = f"{span[0]}-{span[1]}"
        with open(tmp_path / f"{name}.log", "wb") as log:
            running.append((name, subprocess.Popen(
                [*common, "--methods", method, "--seeds", seed, "--name", name],
                stdout=log, stderr=subprocess.STDOUT, env=env)))
    try:
        for name, process in running:
            assert process.wait(timeout=600) == 0, (tmp_path / f"{name}.log").read_text()[-6000:]
    finally:  # after a failure: SIGTERM, on which the benchmark stops its run first
        for _, process in running:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=180)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
    # The same command again reuses the finished run instead of training it again.
    again = subprocess.run([*common, "--methods", "in-batch", "--seeds", "7", "--name",
                            "again"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "in-batch seed 7: reusing the finished run" in again.stdout
    first = json.loads((out / "part-in-batch-7.v1.json").read_text())["runs"][0]
    reused = json.loads((out / "again.json").read_text())["runs"][0]
    assert {k: v for k, v in reused.items() if k != "minutes"} == \
        {k: v for k, v in first.items() if k != "minutes"}
    combine = [sys.executable, str(REPO / "bench" / "quality.py"), "--profile", "cpu", "--out",
               str(out), "--combine"]
    files = [str(out / f"part-{method}-{seed}.v1.json") for method, seed in parts]
    twice = subprocess.run([*combine, files[0], files[2], files[0]], capture_output=True,
                           text=True, timeout=120)
    assert twice.returncode != 0 and "in-batch seed 7 is also in" in twice.stderr
    assert not (out / "quality-cpu.json").exists()
    result = subprocess.run([*combine, *files], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "quality-cpu.json").read_text())
    assert report["methods"] == ["in-batch", "ance"] and report["seeds"] == [7, 8]
    assert {m: s["test"]["ndcg@10"]["n"] for m, s in report["aggregate"].items()} == \
        {"in-batch": 2, "ance": 1}
    in_batch = [r["test"]["ndcg@10"] for r in report["runs"] if r["method"] == "in-batch"]
    assert abs(report["aggregate"]["in-batch"]["test"]["ndcg@10"]["mean"]
               - sum(in_batch) / 2) < 1e-12
    assert [part["methods"] for part in report["parts"]] == [["in-batch"], ["ance"], ["in-batch"]]
    # --max-doc-length is recorded as the override it is.
    assert report["overrides"] == ["training.learning_rate=3e-5", "inference.replicas=1",
                                   "model.max_doc_length=32"]
    bm25 = report["references"]["BM25 (bm25s k1=0.9 b=0.4)"]
    zero_shot = report["references"]["zero-shot (no training)"]
    for ref in (bm25, zero_shot):
        assert 0.0 <= ref["test"]["ndcg@10"] <= 1.0 and 0.0 <= ref["dev"]["ndcg@10"] <= 1.0
    assert bm25["test"]["ndcg@10"] > 0.3, "BM25 on this SciFact subset is far from random"
    for run in report["runs"]:
        steps = [r["step"] for r in run["refreshes"]]
        assert steps[0] == 0 and steps[-1] == 6 and run["selected_step"] in steps
        # The default --select auto: export's rule (protocol/selection.py), on dev alone:
        # the subset's dev split is under MIN_DEV_QUERIES, so the latest checkpoint within
        # the best's interval.
        assert run["selection"] == "auto"
        dev = [r["metrics"]["dev"]["ndcg@10"] for r in run["refreshes"]]
        best = max(range(len(dev)), key=lambda i: (dev[i], -i))
        floor = run["refreshes"][best]["ci95"]["dev"]["ndcg@10"][0]
        assert run["selected_step"] == max(r["step"] for r, value in zip(
            run["refreshes"], dev, strict=True) if value >= floor), "selection must be on dev"
        selected = next(r for r in run["refreshes"] if r["step"] == run["selected_step"])
        assert run["test"] == selected["metrics"]["test"]
        assert run["config"]["training"]["seed"] == run["seed"]
        assert run["config"]["training"]["learning_rate"] == 3e-5
        assert run["refreshes"][0]["metrics"] == report["runs"][0]["refreshes"][0]["metrics"], \
            "checkpoint 0 is the same pretrained model for every method"
    assert [(r["method"], r["seed"]) for r in report["runs"]] == \
        [("in-batch", 7), ("in-batch", 8), ("ance", 7)]
    markdown = (out / "quality-cpu.md").read_text()
    assert "| ance | 7 |" in markdown and "| in-batch | 7, 8 |" in markdown
    assert "reference" in markdown and " ± " in markdown
    assert report["command"] in markdown
    assert "--combine" in report["merged_by"] and report["merged_by"] in markdown
    for plot in report["plots"]:
        data = (out / plot).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000

    # Paired significance over test queries, rebuilt from the embeddings the runs kept.
    significance = ["--data", str(scifact_subset), "--runs-dir", str(tmp_path / "runs"),
                    "--out", str(out)]
    assert significance_cli.main([*significance, str(out / "quality-cpu.json")]) == 0
    sig = json.loads((out / "quality-cpu-significance.json").read_text())
    assert sig["seeds"] == {"in-batch": [7, 8], "ance": [7]}
    assert abs(sig["mean_ndcg@10"]["ance"] - report["aggregate"]["ance"]["test"]["ndcg@10"]
               ["mean"]) < 1e-4
    assert abs(sig["mean_ndcg@10"]["zero-shot"] - zero_shot["test"]["ndcg@10"]) < 1e-4
    assert abs(sig["mean_ndcg@10"]["BM25"] - bm25["test"]["ndcg@10"]) < 1e-9
    assert [(c["method"], c["versus"]) for c in sig["comparisons"]] == \
        [("ance", "in-batch"), ("ance", "zero-shot"), ("ance", "BM25")]
    for row in sig["comparisons"]:
        assert row["wins"] + row["losses"] + row["ties"] == sig["test_queries"]
        assert 0.0 < row["p"] <= 1.0 and row["p"] <= row["p_bh"] <= 1.0
        low, high = row["ci95"]
        assert low <= row["delta"] <= high
        expected = sig["mean_ndcg@10"][row["method"]] - sig["mean_ndcg@10"][row["versus"]]
        assert abs(row["delta"] - expected) < 1e-9
    assert "| ance | in-batch |" in (out / "quality-cpu-significance.md").read_text()
    # A report whose number the stored embeddings do not reproduce is refused, naming it.
    report["runs"][0]["test"]["ndcg@10"] += 0.01
    (out / "tampered.json").write_text(json.dumps(report))
    with pytest.raises(SystemExit, match="rebuilt gives test nDCG@10"):
        significance_cli.main([*significance, str(out / "tampered.json")])

    # A variant (--set negatives.*) is merged beside its method under its own --label. This
    # one sets ANCE's own top_k again, so it reuses the finished run: the same run, renamed.
    top_k = next(r for r in report["runs"] if r["method"] == "ance")["config"]["negatives"][
        "top_k"]
    labelled = subprocess.run([*common, "--methods", "ance", "--seeds", "7", "--set",
                               f"negatives.top_k={top_k}", "--label", "ance-same-k", "--name",
                               "variant"], capture_output=True, text=True, timeout=300)
    assert labelled.returncode == 0, labelled.stdout[-3000:] + labelled.stderr[-3000:]
    assert "ance seed 7: reusing the finished run" in labelled.stdout
    result = subprocess.run([*combine, *files, str(out / "variant.json"), "--name", "variants"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    merged = json.loads((out / "variants.json").read_text())
    assert merged["methods"] == ["in-batch", "ance", "ance-same-k"]
    assert merged["variants"] == {"ance-same-k": {"method": "ance", "overrides": [
        "training.learning_rate=3e-5", "inference.replicas=1", f"negatives.top_k={top_k}",
        "model.max_doc_length=32"]}}
    assert merged["overrides"] == ["training.learning_rate=3e-5", "inference.replicas=1",
                                   "model.max_doc_length=32"]
    assert merged["aggregate"]["ance-same-k"] == merged["aggregate"]["ance"]
    assert "Variants: ance-same-k = ance with" in (out / "variants.md").read_text()
    assert significance_cli.main([*significance, str(out / "variants.json")]) == 0
    rows = {(c["method"], c["versus"]): c for c in json.loads(
        (out / "variants-significance.json").read_text())["comparisons"]}
    assert set(rows) == {(m, v) for m in ("ance", "ance-same-k")
                         for v in ("in-batch", "zero-shot", "BM25")}
    assert rows[("ance-same-k", "in-batch")]["delta"] == rows[("ance", "in-batch")]["delta"]
    # The same method name with other overrides, or parts that differ outside negatives.*,
    # are refused by name.
    unlabelled = json.loads((out / "variant.json").read_text())
    for run in unlabelled["runs"]:
        run["method"], run["seed"] = "ance", 9
    (out / "unlabelled.json").write_text(json.dumps(unlabelled))
    refused = subprocess.run([*combine, files[1], str(out / "unlabelled.json")],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "name the variant with --label" in refused.stderr
    other_data = json.loads(Path(files[0]).read_text())
    other_data["overrides"] = [*other_data["overrides"], "data.dev_fraction=0.3"]
    (out / "other-data.json").write_text(json.dumps(other_data))
    refused = subprocess.run([*combine, files[1], str(out / "other-data.json")],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "outside negatives.*" in refused.stderr
    two = subprocess.run([*common, "--methods", "ance", "in-batch", "--label", "x"],
                         capture_output=True, text=True, timeout=120)
    assert two.returncode == 2 and "--label names one method" in two.stderr

    # --runs-dir keeps what the analyses read and drops model checkpoints and caches.
    kept = tmp_path / "runs" / "ance-s7"
    assert not (kept / "work").exists()
    assert not (kept / "store" / "ance-s7" / "checkpoints").exists()
    assert (kept / "store" / "ance-s7" / "negatives" / "bm25.npz").is_file()

    # In-batch negatives only (was tests/test_strategies_e2e.py::test_in_batch_only, whose own
    # end-to-end run this one replaces): no table is mined, not even BM25's; no hard negative
    # is ever used, so the trainer never waits for one.
    for seed in (7, 8):
        kept = tmp_path / "runs" / f"in-batch-s{seed}"
        store = kept / "store" / f"in-batch-s{seed}"
        assert (store / "eval").is_dir(), "the kept run's store, with its evaluations"
        assert sorted(p.name for p in store.glob("negatives/*")) == []
        trainer = json.loads((kept / "summary.json").read_text())["trainer"]
        assert trainer["finished"] and trainer["steps"] == 6
        assert set(trainer["hard_negatives"]) == {0}
        assert trainer["wait_before_first_s"] == 0.0

    # How hard the ANCE run's negatives were, under each checkpoint it stored.
    negative_hardness.main([str(tmp_path / "runs" / "ance-s7"), "--out", str(out)])
    analysed = json.loads((out / "negative-hardness.json").read_text())["runs"][0]
    ance_run = next(r for r in report["runs"] if r["method"] == "ance")
    assert analysed["run_id"] == "ance-s7" and analysed["pool"] == "ann"
    assert [c["step"] for c in analysed["checkpoints"]] == \
        [r["step"] for r in ance_run["refreshes"]]
    for checkpoint in analysed["checkpoints"]:
        assert "bm25" in checkpoint["tables"], "ANCE warms up on BM25 negatives"
        assert checkpoint["positive_rank"]["median"] >= 1
        for stats in [*checkpoint["tables"].values(), checkpoint["random"]]:
            assert 0.0 <= stats["p_above_positive"] <= 1.0
            assert 0.0 <= stats["p_above_near_positive"] <= 1.0
        # A table mined from this very checkpoint holds its top-K non-positives: under the
        # same embeddings they are closer to the positive than uniform corpus documents.
        own = checkpoint["tables"].get(str(checkpoint["step"]))
        if own is not None:
            assert own["mean_gap"] < checkpoint["random"]["mean_gap"]
    assert any(str(c["step"]) in c["tables"] for c in analysed["checkpoints"])


def test_stopping_the_benchmark_stops_its_run(tmp_path: Path, scifact_subset, tiny_model) -> None:
    """SIGTERM to bench/quality.py stops the `ance-train run` it started and that run's
    services: nothing of the benchmark keeps running unseen."""
    import signal
    import time

    import psutil

    bench = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "quality.py"), "--profile", "cpu",
         "--data", str(scifact_subset), "--model", str(tiny_model), "--steps", "400",
         "--refresh-every", "100", "--max-doc-length", "32", "--methods", "in-batch",
         "--seeds", "7", "--runs-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "out")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    trainer_log = tmp_path / "runs" / "in-batch-s7" / "logs" / "trainer.log"
    deadline = time.monotonic() + 240
    while not (trainer_log.exists() and "step" in trainer_log.read_text()):
        assert bench.poll() is None, "the benchmark ended before its run started training"
        assert time.monotonic() < deadline, "the run never started training"
        time.sleep(0.5)
    descendants = psutil.Process(bench.pid).children(recursive=True)
    assert len(descendants) >= 3, "expected the run and its services"  # launcher, trainer, ...
    bench.send_signal(signal.SIGTERM)
    # 143 = 128 + SIGTERM: the benchmark caught the signal and stopped its run before
    # exiting (killed outright it would report -15 and leave the run to die of a broken pipe
    # whenever it next printed).
    assert bench.wait(timeout=180) == 128 + signal.SIGTERM
    _, alive = psutil.wait_procs(descendants, timeout=60)
    assert not alive, [p.cmdline() for p in alive]
    assert not (tmp_path / "out" / "quality-cpu.json").exists(), \
        "a stopped benchmark reports nothing"


def test_overrides_reach_a_strategy_section(monkeypatch) -> None:
    """``--set negatives.simans.a=0.3`` sets a field of a strategy's section, next to the
    values the method's file gives that section; a two-part path still sets a field."""
    from ance_train_dev import quality

    raw = {"negatives": {"pool": "ann", "simans": {"top_k": 100, "a": 0.5}}}
    quality.apply_overrides(raw, ["negatives.simans.a=0.3", "negatives.tele.max_candidates=90",
                                  "negatives.top_k=20", "training.learning_rate=5e-5"])
    assert raw == {"negatives": {"pool": "ann", "simans": {"top_k": 100, "a": 0.3},
                                 "tele": {"max_candidates": 90}, "top_k": 20},
                   "training": {"learning_rate": 5e-5}}
    assert quality.parse_args(["--set", "negatives.simans.a=0.3"]).overrides == [
        "negatives.simans.a=0.3"]
    for bad in ("negatives=3", "negatives..a=1", "top_k=20"):
        with pytest.raises(SystemExit):
            quality.parse_args(["--set", bad])


def test_training_set_cut_keeps_n_queries_and_cuts_dev_from_them(tmp_path: Path,
                                                                  scifact_subset) -> None:
    """``--train-queries N`` (issue 33's small-data proxies): train.tsv keeps exactly N
    queries with a positive, the same N for the same seed, others for another seed; the
    corpus, queries and other qrels are the source's own files; the dev slice cut from train
    comes out of those N."""
    from ance_train.config import DataConfig
    from ance_train.data.validation import validate_dataset

    from ance_train_dev.quality import cut_training_set, parse_args

    def kept(directory: Path) -> set[str]:
        rows = (directory / "qrels" / "train.tsv").read_text().splitlines()
        assert rows[0].split("\t") == ["query-id", "corpus-id", "score"]
        return {row.split("\t")[0] for row in rows[1:]}

    cut = cut_training_set(scifact_subset, 20, 0, tmp_path / "cuts")
    first = kept(cut)
    assert len(first) == 20
    source = {row.split("\t")[0] for row in
              (scifact_subset / "qrels" / "train.tsv").read_text().splitlines()[1:]}
    assert first < source
    assert (cut / "corpus.jsonl").resolve() == (scifact_subset / "corpus.jsonl").resolve()
    assert (cut / "qrels" / "test.tsv").read_text() == \
        (scifact_subset / "qrels" / "test.tsv").read_text()
    assert kept(cut_training_set(scifact_subset, 20, 0, tmp_path / "again")) == first
    assert kept(cut_training_set(scifact_subset, 20, 1, tmp_path / "cuts")) != first

    index = validate_dataset(DataConfig(path=str(cut), dev_fraction=0.1), tmp_path / "cache")
    assert len(index.dev) == 2 and len(index.train) == 18
    assert set(index.dev) | set(index.train) == first

    # Parallel lanes (bench/quality_lanes.sh) cut the same dataset at once: every process
    # gets the one identical cut, and no staging directory is left behind.
    with ProcessPoolExecutor(4) as pool:
        cuts = list(pool.map(cut_training_set, [scifact_subset] * 8, [20] * 8, [2] * 8,
                             [tmp_path / "raced"] * 8))
    assert len(set(cuts)) == 1 and kept(cuts[0]) == kept(cut_training_set(
        scifact_subset, 20, 2, tmp_path / "alone"))
    assert [path.name for path in (tmp_path / "raced").iterdir()] == [cuts[0].name]

    with pytest.raises(SystemExit, match="only"):
        cut_training_set(scifact_subset, len(source) + 1, 0, tmp_path / "cuts")
    args = parse_args(["--data", str(scifact_subset), "--train-queries", "20"])
    assert args.dataset == f"{scifact_subset.name}-train20"


def test_small_data_report_selects_by_each_rule(tmp_path: Path) -> None:
    """bench/quality_small.py on a hand-made combined report (logic only, no run): auto (the
    latest checkpoint within the dev noise of the best, 15 dev queries being under the floor),
    the best dev checkpoint and the earliest one within its interval, the curves, and the
    paired differences against zero-shot and the peer, read from the significance file."""
    from ance_train_dev import quality_small

    def refresh(step: int, dev: float, test: float, low: float | None = None) -> dict:
        return {"step": step, "metrics": {"dev": {"ndcg@10": dev}, "test": {"ndcg@10": test}},
                "ci95": {"dev": {"ndcg@10": [low, dev + 0.05]}} if low is not None else {}}

    runs = [{"method": "ance", "seed": seed, "selection": "auto", "dev_queries": 15,
             "config": {"training": {"wise_ft_alpha": "auto"}}, "refreshes": [
        refresh(0, 0.50, 0.60, 0.45), refresh(15, 0.58 + d, 0.66, 0.52),
        refresh(30, 0.60 + d, 0.63, 0.55), refresh(45, 0.56 + d, 0.64, 0.50)]}
        for seed, d in ((13, 0.0), (42, 0.01))]
    report = {"dataset": "scifact-train150", "profile": "cpu", "budget": {"steps": 30},
              "train_queries": 150, "machine": "test", "date": "today", "runs": runs,
              "references": {"zero-shot (no training)": {"dev": {"ndcg@10": 0.5},
                                                         "test": {"ndcg@10": 0.6}}}}
    significance = {"test_queries": 300, "comparisons": [
        {"method": "ance", "versus": "zero-shot", "delta": 0.045, "p_bh": 0.01},
        {"method": "ance", "versus": "st-static", "delta": -0.002, "p_bh": 0.8}]}
    (tmp_path / "small.json").write_text(json.dumps(report))
    (tmp_path / "small-significance.json").write_text(json.dumps(significance))

    assert quality_small.main([str(tmp_path / "small.json"), "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "quality-small.json").read_text())["datasets"][0]
    rules = written["methods"]["ance"]["rules"]
    assert rules["auto"]["steps"] == [45, 45]  # 0.56 >= 0.55: within the best's noise
    assert rules["auto"]["test_stats"]["mean"] == pytest.approx(0.64)
    assert rules["best"]["steps"] == [30, 30]
    assert rules["earliest-within-noise"]["steps"] == [15, 15]  # 0.58 >= 0.55, 0.50 < 0.55
    assert rules["earliest-within-noise"]["test_stats"]["mean"] == pytest.approx(0.66)
    assert written["curves"]["ance"]["0"]["test"] == pytest.approx(0.60)
    markdown = (tmp_path / "quality-small.md").read_text()
    assert "+0.0450 (p = 0.010)" in markdown and "-0.0020 (p = 0.800)" in markdown
    assert "Dev queries: 15." in markdown and "wise_ft_alpha` of the runs (the peer has " \
        "none): auto" in markdown


def test_small_data_report_recounts_dev_for_an_older_report(
        tmp_path: Path, scifact_subset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A report from before quality.py recorded each run's dev-split size: quality_small makes
    the same cut again (fixed --cut-seed) and applies the run's data settings to count it."""
    from ance_train_dev import quality_small

    monkeypatch.setitem(quality_small.DATASETS, "scifact", scifact_subset)
    report = {"dataset": "scifact-train20", "train_queries": 20, "cut_seed": 0}
    run = {"config": {"data": {"format": "beir", "path": "/gone", "dev_fraction": 0.1}}}
    assert quality_small.dev_queries(report, run, tmp_path) == 2  # 10 % of the 20 cut
    run["config"]["data"]["dev_fraction"] = 0.25
    assert quality_small.dev_queries(report, run, tmp_path / "other") == 5
    assert quality_small.dev_queries(report, {"dev_queries": 7}, tmp_path) == 7


def test_a_recipe_variant_merges_but_a_budget_change_does_not() -> None:
    """Which parts --combine accepts side by side (logic only, on report dicts): a labelled
    variant may change negatives.* and the optimiser's recipe (a learning rate), not the
    budget every method shares."""
    from ance_train_dev.quality import _comparable, _shared_overrides

    def part(overrides: list[str], **training: float) -> dict:
        budget = {"training": {"steps": 30, "batch_size": 16, "learning_rate": 5e-5,
                               "refresh_every": 15, "seed": 13, **training}}
        return {"overrides": overrides, "budget": budget}

    base = part([])
    lower_lr = part(["training.learning_rate=2e-5"], learning_rate=2e-5, seed=42)
    assert _comparable(lower_lr, "budget") == _comparable(base, "budget")
    assert _shared_overrides(lower_lr["overrides"]) == _shared_overrides(base["overrides"])
    assert _shared_overrides(["negatives.top_k=20", "training.warmup_steps=0"]) == []
    longer = part(["training.steps=60"], steps=60)
    assert _comparable(longer, "budget") != _comparable(base, "budget")
    assert _shared_overrides(longer["overrides"]) == ["training.steps=60"]
    assert _shared_overrides(["training.learning_rate_scale=2"]) == [
        "training.learning_rate_scale=2"]  # a prefix of a recipe field is not that field
