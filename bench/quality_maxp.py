"""Does MaxP recover what FirstP at a short length loses? (issue 32; ANCE arXiv:2007.00808 §5)

Merges the part reports of ``bench/quality.py`` runs of one method under three document
settings, the same budget otherwise (the cpu profile; ``--max-doc-length 128``):

* ``firstp128``: each document's first 128 tokens (``model.max_doc_length: 128``);
* ``maxp128``: passages of 128 tokens, at most 4, a document scored by its best passage
  (``--set data.passages.mode=max``);
* ``firstp256``: the first 256 tokens (``--max-doc-length 256``), the reference.

SciFact abstracts run to about 250-300 tokens, so FirstP at 128 sees about half of each. The
checkpoint of each run is selected on **dev** nDCG@10 and **test** is reported for it (as
``bench/quality.py`` does). Each setting also has its own zero-shot row (checkpoint 0 of its
runs: the same pretrained model, encoding the documents that setting's way). Differences
are paired by seed, against ``firstp128``.

    python bench/quality_maxp.py docs/benchmarks/quality-maxp-parts/maxp-*-s*.json

Writes ``quality-maxp.json`` / ``quality-maxp.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from ance_train_dev.report import command_line, utc_now, write_report

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {  # label in the part reports → what it is
    "ance-firstp128": "FirstP, 128 tokens",
    "ance-maxp128": "MaxP, passages of 128 tokens (at most 4)",
    "ance-firstp256": "FirstP, 256 tokens (reference)",
}
BASE = "ance-firstp128"
MEASURES = ("ndcg@10", "mrr@10", "recall@100")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="+", type=Path, help="bench/quality.py part reports")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    return parser.parse_args(argv)


def mean_std(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}


def cell(stat: dict) -> str:
    return f"{stat['mean']:.4f} ± {stat['std']:.4f}" if stat["n"] > 1 else f"{stat['mean']:.4f}"


def collect(parts: list[Path]) -> tuple[dict[str, dict[int, dict]], list[dict]]:
    """Runs by setting and seed, and the part reports (for commands and machines)."""
    runs: dict[str, dict[int, dict]] = {label: {} for label in SETTINGS}
    reports = []
    for path in parts:
        report = json.loads(path.read_text())
        reports.append({"path": str(path), "command": report["command"],
                        "date": report["date"], "machine": report["machine"],
                        "budget": report["budget"]})
        for run in report["runs"]:
            if run["method"] not in runs:
                raise SystemExit(f"{path}: run of {run['method']!r}, expected one of "
                                 f"{sorted(SETTINGS)}")
            runs[run["method"]][run["seed"]] = run
    missing = [label for label, by_seed in runs.items() if not by_seed]
    if missing:
        raise SystemExit(f"no runs of {missing} among the parts")
    return runs, reports


def summarise(runs: dict[str, dict[int, dict]]) -> dict:
    """Per setting: selected-checkpoint test/dev metrics, zero-shot metrics, and the paired
    difference of test nDCG@10 against ``BASE`` over the seeds both have."""
    result = {}
    for label, by_seed in runs.items():
        seeds = sorted(by_seed)
        zero = [by_seed[s]["refreshes"][0] for s in seeds]
        assert all(z["step"] == 0 for z in zero)
        entry = {
            "description": SETTINGS[label], "seeds": seeds,
            "selected_steps": [by_seed[s]["selected_step"] for s in seeds],
            "minutes": [round(by_seed[s]["minutes"], 1) for s in seeds],
            "dev": {m: mean_std([by_seed[s]["dev"][m] for s in seeds]) for m in MEASURES},
            "test": {m: mean_std([by_seed[s]["test"][m] for s in seeds]) for m in MEASURES},
            "zero_shot": {split: {m: mean_std([z["metrics"][split][m] for z in zero])
                                  for m in MEASURES} for split in ("dev", "test")},
        }
        shared = [s for s in seeds if s in runs[BASE]]
        if label != BASE and shared:
            diffs = [by_seed[s]["test"]["ndcg@10"] - runs[BASE][s]["test"]["ndcg@10"]
                     for s in shared]
            entry["test_ndcg_vs_base"] = {**mean_std(diffs), "per_seed": dict(zip(
                map(str, shared), diffs, strict=True))}
        result[label] = entry
    return result


def conclusion(runs: dict[str, dict[int, dict]], summary: dict) -> str:
    """The three settings compared on the seeds all of them ran (paired by seed)."""
    shared = sorted(set.intersection(*(set(by_seed) for by_seed in runs.values())))
    if not shared:
        return "No seed was run with all three settings: nothing to compare yet."

    def test(label: str) -> float:
        return statistics.fmean(runs[label][s]["test"]["ndcg@10"] for s in shared)

    base, maxp, ref = test(BASE), test("ance-maxp128"), test("ance-firstp256")
    lost = ref - base
    share = f"{(maxp - base) / lost:.0%}" if abs(lost) > 1e-9 else "n/a"
    return (f"On the seeds all three settings ran ({', '.join(map(str, shared))}), test "
            f"nDCG@10 of the checkpoint selected on dev: FirstP 128 {base:.4f}, MaxP 128 "
            f"{maxp:.4f}, FirstP 256 {ref:.4f}. FirstP at 128 loses {lost:.4f} against 256; "
            f"MaxP recovers {share} of that ({maxp - base:+.4f}). Zero-shot (no training) "
            f"test nDCG@10: FirstP 128 "
            f"{summary[BASE]['zero_shot']['test']['ndcg@10']['mean']:.4f}, MaxP 128 "
            f"{summary['ance-maxp128']['zero_shot']['test']['ndcg@10']['mean']:.4f}, FirstP "
            f"256 {summary['ance-firstp256']['zero_shot']['test']['ndcg@10']['mean']:.4f}.")


def render(report: dict) -> str:
    summary = report["settings"]
    first = report["parts"][0]
    machine = first["machine"]
    lines = [
        "# Long documents on SciFact: FirstP 128 vs MaxP 128 vs FirstP 256", "",
        f"Merged by: `{report['command']}`", "",
        "Parts (each `python bench/quality.py --profile cpu --methods ance --seeds S "
        "--label L ...`): " + "; ".join(f"`{p['command']}`" for p in report["parts"]), "",
        f"Machine: {machine['cpu']} ({', '.join(machine.get('cpu_flags', []))}) — "
        f"{machine['cores']} cores, torch {machine['torch']}; parts from "
        f"{min(p['date'] for p in report['parts'])} to "
        f"{max(p['date'] for p in report['parts'])}.", "",
        f"Budget (each setting, besides its document setting): `{json.dumps(first['budget'])}`"
        ". The checkpoint of each run is selected on dev nDCG@10; test is reported for it "
        "(mean ± sample std over seeds). Zero-shot is checkpoint 0 of the same runs: the "
        "pretrained model with the setting's documents.", "",
        "| setting | seeds | selected | dev nDCG@10 | test nDCG@10 | test MRR@10 | test R@100 "
        "| Δ test nDCG@10 vs FirstP 128 (paired) | zero-shot test nDCG@10 | minutes per run |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summary.values():
        delta = s.get("test_ndcg_vs_base")
        shift = "–" if delta is None else f"{delta['mean']:+.4f} ± {delta['std']:.4f}"
        lines.append(
            f"| {s['description']} | {', '.join(map(str, s['seeds']))} | "
            f"{', '.join(map(str, s['selected_steps']))} | {cell(s['dev']['ndcg@10'])} | "
            f"{cell(s['test']['ndcg@10'])} | {cell(s['test']['mrr@10'])} | "
            f"{cell(s['test']['recall@100'])} | "
            f"{shift} | "
            f"{cell(s['zero_shot']['test']['ndcg@10'])} | "
            f"{', '.join(map(str, s['minutes']))} |")
    lines += ["", report["conclusion"], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs, parts = collect(args.parts)
    summary = summarise(runs)
    report = {"command": command_line(), "date": utc_now(), "parts": parts,
              "settings": summary, "conclusion": conclusion(runs, summary)}
    write_report(args.out, "quality-maxp", report, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
