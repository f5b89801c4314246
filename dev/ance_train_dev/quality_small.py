"""Small training sets (issue 33): the quality benchmark's 150-query proxies side by side.

Most people who fine-tune a retriever have a few hundred labelled queries. The proxies cut a
dataset's training queries to 150 with a fixed draw (``bench/quality.py --train-queries 150
--cut-seed 0``); test (and NFCorpus's official dev) stay whole. Where the dev slice is cut
from train (SciFact), it is cut from the 150, as it would be for a user who has only those
(15 dev queries with ``data.dev_fraction`` 0.1, below the dev floor of 50).

This script reads, per proxy, the report that ``bench/quality.py --combine`` merged from the
part runs and the paired significance that ``bench/significance.py`` computed from the stored
runs (``<report stem>-significance.json`` beside it), and writes one table:

* each method's test nDCG@10 at the checkpoint selected on dev by ``auto`` (what ``ance-train
  export --checkpoint best`` picks: the latest checkpoint within the dev noise of the best
  below 50 dev queries, else the best; ``protocol/selection.py``), mean ± std over seeds,
  with the checkpoints selected;
* the same under ``best`` (the highest dev value) and ``earliest-within-noise`` (the earliest
  checkpoint whose dev nDCG@10 reaches the lower end of the best one's bootstrap 95 %
  interval), recomputed from the stored dev curves: no training is repeated;
* paired differences over test queries against zero-shot and the peer (randomization test,
  Benjamini-Hochberg adjusted over each significance table), computed by
  ``bench/significance.py`` at the rule the runs reported (their ``selection``: ``auto`` since
  the rule became the default, ``best`` before);
* the per-checkpoint dev and test curves (mean over seeds), which show when a run stops
  gaining.

    python bench/quality_small.py docs/benchmarks/quality-small-scifact150.json \\
        docs/benchmarks/quality-small-nfcorpus150.json

Writes ``quality-small.json`` / ``quality-small.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from ance_train.config import DataConfig
from ance_train.data.validation import validate_dataset

from ance_train_dev.quality import DATASETS, PEER, cut_training_set, display_name, select_checkpoint
from ance_train_dev.report import command_line, machine_line, utc_now, write_report

REPO = Path(__file__).resolve().parents[2]
MEASURE = "ndcg@10"
ZERO_SHOT = "zero-shot"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path,
                        help="Combined bench/quality.py reports, one per proxy dataset; each "
                             "with its <stem>-significance.json beside it.")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    parser.add_argument("--name", default="quality-small")
    return parser.parse_args(argv)


def _stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}


RULES = ("auto", "best", "earliest-within-noise")


def dev_queries(report: dict, run: dict, scratch: Path) -> int:
    """The run's dev-split size, which ``auto`` needs: recorded by ``bench/quality.py`` since
    it became the default rule; for an older report, the cut is made again (``--cut-seed`` is
    fixed, so it is the same draw) and the run's data settings applied to it."""
    if run.get("dev_queries") is not None:
        return int(run["dev_queries"])
    source = DATASETS[report["dataset"].split("-train")[0]]
    data = source
    if report.get("train_queries") is not None:
        data = cut_training_set(source, report["train_queries"], report.get("cut_seed", 0),
                                scratch)
    settings = {**run["config"]["data"], "path": str(data)}
    index = validate_dataset(DataConfig(**settings), scratch / f"index-{data.name}")
    return len(index.dev)


def method_rows(report: dict, scratch: Path) -> dict[str, dict]:
    """Per method: the selected checkpoints and their dev/test nDCG@10 under each rule."""
    rows: dict[str, dict] = {}
    for run in report["runs"]:
        row = rows.get(run["method"])
        if row is None:  # a method's seeds share their data, so its dev split is counted once
            blend = run.get("config", {}).get("training", {}).get("wise_ft_alpha", 1.0)
            row = rows[run["method"]] = {
                "seeds": [], "rules": {}, "dev_queries": dev_queries(report, run, scratch),
                "significance_rule": run.get("selection", "best"), "wise_ft_alpha": blend}
        row["seeds"].append(run["seed"])
        for rule in RULES:
            chosen = select_checkpoint(run["refreshes"], rule, MEASURE, row["dev_queries"])
            picked = row["rules"].setdefault(rule, {"steps": [], "dev": [], "test": []})
            picked["steps"].append(chosen["step"])
            picked["dev"].append(chosen["metrics"]["dev"][MEASURE])
            picked["test"].append(chosen["metrics"]["test"][MEASURE])
    for row in rows.values():
        for picked in row["rules"].values():
            picked["dev_stats"] = _stats(picked["dev"])
            picked["test_stats"] = _stats(picked["test"])
    return rows


def curves(report: dict) -> dict[str, dict[int, dict]]:
    """Per method and checkpoint step: mean dev and test nDCG@10 over seeds."""
    gathered: dict[str, dict[int, dict[str, list[float]]]] = {}
    for run in report["runs"]:
        for refresh in run["refreshes"]:
            point = gathered.setdefault(run["method"], {}).setdefault(
                refresh["step"], {"dev": [], "test": []})
            point["dev"].append(refresh["metrics"]["dev"][MEASURE])
            point["test"].append(refresh["metrics"]["test"][MEASURE])
    return {method: {step: {split: statistics.fmean(values) for split, values in point.items()}
                     for step, point in sorted(steps.items())}
            for method, steps in gathered.items()}


def dev_noise(report: dict) -> float | None:
    """Half-width of the bootstrap 95 % interval of dev nDCG@10 at checkpoint 0 (the same
    model in every run), the dev set's noise."""
    for run in report["runs"]:
        zero = next((r for r in run["refreshes"] if r["step"] == 0), None)
        interval = (zero or {}).get("ci95", {}).get("dev", {}).get(MEASURE)
        if interval:
            return (interval[1] - interval[0]) / 2
    return None


def comparisons(significance: dict) -> dict[tuple[str, str], dict]:
    return {(c["method"], c["versus"]): c for c in significance["comparisons"]}


def summarise(path: Path, scratch: Path) -> dict:
    report = json.loads(path.read_text())
    significance_path = path.with_name(f"{path.stem}-significance.json")
    significance = json.loads(significance_path.read_text())
    references = {name.split(" ")[0]: value for name, value in report["references"].items()}
    return {"report": str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path),
            "significance": significance_path.name,
            "dataset": report["dataset"], "profile": report["profile"],
            "budget": report.get("budget"), "train_queries": report.get("train_queries"),
            "variants": report.get("variants", {}), "overrides": report.get("overrides", []),
            "machine": report.get("machine"), "date": report.get("date"),
            "references": {name: value["test"][MEASURE] for name, value in references.items()},
            "references_dev": {name: value["dev"][MEASURE] for name, value in references.items()},
            "dev_ci95_halfwidth": dev_noise(report),
            "methods": method_rows(report, scratch), "curves": curves(report),
            "comparisons": [c for c in significance["comparisons"]
                            if c["versus"] in (ZERO_SHOT, PEER, "BM25")
                            or c["method"] in (ZERO_SHOT, PEER)],
            "test_queries": significance.get("test_queries")}


def _cell(stats: dict) -> str:
    return f"{stats['mean']:.4f} ± {stats['std']:.4f}"


def _versus(found: dict[tuple[str, str], dict], method: str, other: str) -> str:
    comparison = found.get((method, other))
    sign = 1
    if comparison is None:
        comparison, sign = found.get((other, method)), -1
    if comparison is None:
        return "–"
    return f"{sign * comparison['delta']:+.4f} (p = {comparison['p_bh']:.3f})"


def render(datasets: list[dict]) -> str:
    lines = ["# Small training sets: the 150-query proxies (issue 33)", "",
             "Test nDCG@10 at the checkpoint selected on **dev**, mean ± std over seeds, by "
             "three rules: `auto` (what `ance-train export --checkpoint best` picks: the "
             "latest checkpoint within the dev noise of the best below 50 dev queries, else "
             "the best), `best` (the highest dev value) and `earliest` (the earliest "
             "checkpoint within the dev noise of the best; noise: the best's bootstrap 95 % "
             "interval). Δ: paired over test queries (per-query nDCG@10 averaged over seeds) "
             "at the rule the runs reported (column `Δ at`), randomization test, p adjusted "
             "by Benjamini-Hochberg within each dataset's significance table.", ""]
    for data in datasets:
        found = {(c["method"], c["versus"]): c for c in data["comparisons"]}
        budget = data.get("budget") or {}
        noise = data["dev_ci95_halfwidth"]
        noise_text = ("" if noise is None else
                      f" Dev nDCG@10 at zero-shot has a 95 % interval of ±{noise:.3f}.")
        blends = sorted({str(row["wise_ft_alpha"]) for method, row in data["methods"].items()
                         if method != PEER})
        lines += [f"## {display_name(data['dataset'])}, `{data['profile']}` profile, "
                  f"`wise_ft_alpha` {', '.join(blends)}", "",
                  f"Report `{data['report']}` (profile `{data['profile']}`, budget "
                  f"{json.dumps(budget)}), {data['test_queries']} test queries; "
                  f"machine {machine_line(data['machine'])}, {data['date']}.{noise_text}", "",
                  "| system | test (auto) | checkpoints (auto) | test (best) | "
                  "checkpoints (best) | test (earliest) | checkpoints (earliest) | "
                  "dev (auto) | Δ at | Δ vs zero-shot | Δ vs peer |",
                  "|---|---:|---|---:|---|---:|---|---:|---|---|---|"]
        for name, value in data["references"].items():
            lines.append(f"| {name} | {value:.4f} | – | – | – | – | – | "
                         f"{data['references_dev'][name]:.4f} | – | – | "
                         f"{_versus(found, name, PEER) if name != PEER else '–'} |")
        for method, row in data["methods"].items():
            auto, best = row["rules"]["auto"], row["rules"]["best"]
            early = row["rules"]["earliest-within-noise"]
            lines.append(
                f"| {method} | {_cell(auto['test_stats'])} | {auto['steps']} | "
                f"{_cell(best['test_stats'])} | {best['steps']} | "
                f"{_cell(early['test_stats'])} | {early['steps']} | "
                f"{_cell(auto['dev_stats'])} | {row['significance_rule']} | "
                f"{_versus(found, method, ZERO_SHOT)} | "
                f"{_versus(found, method, PEER) if method != PEER else '–'} |")
        dev_counts = sorted({row["dev_queries"] for row in data["methods"].values()})
        lines += ["", f"Dev queries: {', '.join(map(str, dev_counts))}. "
                  f"`training.wise_ft_alpha` of the runs (the peer has none): "
                  f"{', '.join(blends)} (`auto`: 0.5 below 500 training queries)."]
        if data.get("variants"):
            lines += ["", "Variants: " + "; ".join(
                f"{label} = {v['method']} with "
                + ", ".join(f"`{o}`" for o in v["overrides"] if o not in data["overrides"])
                for label, v in data["variants"].items()) + "."]
        steps = sorted({step for curve in data["curves"].values() for step in curve})
        lines += ["", "Per checkpoint, mean over seeds (dev / test nDCG@10):", "",
                  "| method | " + " | ".join(str(s) for s in steps) + " |",
                  "|---|" + "---:|" * len(steps)]
        for method, curve in data["curves"].items():
            cells = [f"{curve[s]['dev']:.3f} / {curve[s]['test']:.3f}" if s in curve else "–"
                     for s in steps]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="quality-small-") as scratch:
        datasets = [summarise(path.resolve(), Path(scratch)) for path in args.reports]
    report = {"command": command_line(), "date": utc_now(), "datasets": datasets}
    write_report(args.out, args.name, report, render(datasets))
    return 0
