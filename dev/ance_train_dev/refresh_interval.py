"""The refresh-interval comparison (issue 31, item 3): do fresher negatives help at a budget?

ANCE ("Approximate Nearest Neighbor Negative Contrastive Learning for Dense Text Retrieval",
Xiong et al., ICLR 2021, arXiv:2007.00808) trains on negatives from an ANN index that an
Inferencer refreshes asynchronously every m batches (§4, "Asynchronous Index Refresh"), so
the trainer always learns from negatives mined by an earlier checkpoint: the async-gap.
§6.4 ("Impact of Asynchronous Gap") finds that too large a gap (too low a refresh rate) makes
training unstable, while shrinking it below what an equal Trainer:Inferencer allocation
gives does not improve convergence. The quickstart refreshes every
``training.refresh_every`` = 20 steps of 60 (configs/quickstart.yaml); whether a shorter
interval (fresher negatives, more refreshes competing for the same two cores) pays off at
that budget is a question of this dataset and machine, answered here on **dev**.

This module reads the reports of ``bench/quality.py`` invocations that differ in
``--refresh-every`` only (method ``ance``, the same seeds, the quickstart budget), e.g.

    python bench/refresh_interval.py /work/runs-interval/out/refresh-every-20.json \\
        /work/runs-interval/out/refresh-every-10.json --baseline 20

groups their runs by ``config.training.refresh_every`` and refuses (naming the file and the
field) reports whose runs differ in anything else: the method, the data path, or any config
field besides ``training.refresh_every``, ``training.seed`` and the run's bookkeeping
(``run_id``, ``output_dir``; ``negatives.warmup_steps`` where it is the one refresh interval
``bench/quality.py`` derives from ``--refresh-every``). For each interval it reports, per
seed and as mean ± sample sd over seeds:

* dev nDCG@10 at the final checkpoint (the evaluation at ``step == training.steps``) and at
  the checkpoint selected on dev (the run's ``dev``); test nDCG@10 of both, reported only;
* the number of checkpoints evaluated (the zero-shot checkpoint 0 included);
* the negatives actually trained on: the distinct ``negatives_step`` (>= 0) in use at some
  training step (from the run's ``swaps``);
* the staleness: for each training step s in 1..steps on ANN negatives mined from checkpoint
  n, s − n (1: mined from the checkpoint just before the step), averaged over those steps;
  steps before the first swap or on the BM25 warm-up table (n = −1) are counted apart as
  warm-up steps;
* minutes per run (wall-clock, on a machine that may have been shared).

Then paired per-seed differences of dev nDCG@10 (final and selected) of every interval
against ``--baseline`` (default 20), with their mean, min and max over seeds, and the
decision (``RULE``). Writes ``<name>.json`` and ``<name>.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from ance_train_dev.quality import mean_std
from ance_train_dev.report import command_line, machine_line, utc_now, write_report

REPO = Path(__file__).resolve().parents[2]
MEASURE = "ndcg@10"
# The quickstart's training.refresh_every (configs/quickstart.yaml) when this comparison was
# made: the default the other intervals must beat.
BASELINE = 20
# A run's bookkeeping: where it was written, under which name; not part of its budget.
BOOKKEEPING = ("run_id", "output_dir")
RULE = ("the winner is the interval with the highest mean dev nDCG@10 at the dev-selected "
        "checkpoint; if its paired gain over the baseline is not positive for every seed, "
        "the baseline stays (not separable from noise at this number of seeds)")
NOTE_SELECTION = ("A shorter interval evaluates more checkpoints, so its dev-selected maximum "
                  "has more draws of dev noise to pick from; the final-checkpoint columns "
                  "have no such advantage.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, metavar="REPORT_JSON",
                        help="bench/quality.py reports, one per --refresh-every (method ance, "
                             "the same seeds and budget otherwise).")
    parser.add_argument("--baseline", type=int, default=BASELINE,
                        help="The refresh interval the others are paired against and that "
                             f"stays unless beaten on every seed (default {BASELINE}, the "
                             "quickstart's training.refresh_every).")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    parser.add_argument("--name", default="refresh-interval-cpu")
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------- comparability


def budget_of(config: dict) -> dict:
    """``config`` without what may differ between the compared runs: the refresh interval,
    the seed, the bookkeeping, and the BM25 warm-up where it is the one refresh interval that
    ``bench/quality.py`` derives from ``--refresh-every`` (``min(refresh_every, steps − 1)``)."""
    budget = {key: value for key, value in config.items() if key not in BOOKKEEPING}
    training = dict(config.get("training", {}))
    interval = training.pop("refresh_every", None)
    training.pop("seed", None)
    budget["training"] = training
    negatives = dict(config.get("negatives", {}))
    steps = training.get("steps")
    if (interval is not None and steps is not None
            and negatives.get("warmup_steps") == min(interval, steps - 1)):
        negatives["warmup_steps"] = "one refresh interval"
    if "negatives" in config:
        budget["negatives"] = negatives
    return budget


def differences(a: object, b: object, prefix: str = "") -> list[str]:
    """The dotted fields where ``a`` and ``b`` differ (nested dicts compared key by key)."""
    if isinstance(a, dict) and isinstance(b, dict):
        found = []
        for key in sorted(set(a) | set(b), key=str):
            where = f"{prefix}.{key}" if prefix else str(key)
            if key not in a or key not in b:
                found.append(where)
            else:
                found += differences(a[key], b[key], where)
        return found
    return [] if a == b else [prefix]


def _field(config: dict, dotted: str) -> object:
    value: object = config
    for key in dotted.split("."):
        value = value.get(key, "(absent)") if isinstance(value, dict) else "(absent)"
    return value


def check_comparable(loaded: list[tuple[Path, dict]]) -> None:
    """Every run of every report against the first run of the first report: the same
    method, data path and budget (``budget_of``). Stops naming the file and the field."""
    first_path, first_report = loaded[0]
    if not first_report.get("runs"):
        raise SystemExit(f"{first_path}: no runs")
    reference = first_report["runs"][0]
    ref_config = reference["config"]
    for path, report in loaded:
        if not report.get("runs"):
            raise SystemExit(f"{path}: no runs")
        for run in report["runs"]:
            where = f"{path}: run {run['method']} seed {run['seed']}"
            if run["method"] != reference["method"]:
                raise SystemExit(f"{where}: method is {run['method']!r}, {reference['method']!r}"
                                 f" in {first_path}; compare one method")
            config = run["config"]
            data_path, ref_data_path = _field(config, "data.path"), _field(ref_config,
                                                                            "data.path")
            if data_path != ref_data_path:
                raise SystemExit(f"{where}: config.data.path is {data_path!r}, "
                                 f"{ref_data_path!r} in {first_path}; not the same data")
            changed = differences(budget_of(config), budget_of(ref_config))
            if changed:
                field = changed[0]
                raise SystemExit(
                    f"{where}: config.{field} is {_field(config, field)!r}, "
                    f"{_field(ref_config, field)!r} in {first_path}"
                    + (f" (also {', '.join('config.' + f for f in changed[1:])})"
                       if len(changed) > 1 else "")
                    + "; the budgets may differ in training.refresh_every only")


# ----------------------------------------------------------------------------- per run


def staleness(swaps: list[dict], steps: int) -> dict:
    """What the trainer trained on at each step 1..``steps``, from its ``swaps`` (from step
    ``step`` on, the negatives mined from checkpoint ``negatives_step``; −1: BM25).

    ``mean``: the mean of s − negatives_step over the steps on ANN negatives (None if none);
    ``ann_steps``: how many; ``warmup_steps``: steps before the first swap or on BM25;
    ``negatives_steps``: the checkpoints whose negatives were in use at some step."""
    ordered = sorted(swaps, key=lambda swap: swap["step"])  # stable: the later of one step wins
    lags, warmup, used = [], 0, set()
    current, index = None, 0
    for step in range(1, steps + 1):
        while index < len(ordered) and ordered[index]["step"] <= step:
            current = ordered[index]["negatives_step"]
            index += 1
        if current is None or current < 0:
            warmup += 1
        else:
            lags.append(step - current)
            used.add(current)
    return {"mean": statistics.fmean(lags) if lags else None, "ann_steps": len(lags),
            "warmup_steps": warmup, "negatives_steps": sorted(used)}


def run_summary(path: Path, run: dict) -> dict:
    """One run's numbers; stops (naming the file) if it has no evaluation at its last step."""
    steps = run["config"]["training"]["steps"]
    final = next((r for r in run["refreshes"] if r["step"] == steps), None)
    if final is None:
        raise SystemExit(f"{path}: run {run['method']} seed {run['seed']}: no evaluation at "
                         f"the final step {steps} in refreshes (steps "
                         f"{[r['step'] for r in run['refreshes']]}); did it stop early?")
    stale = staleness(run["swaps"], steps)
    return {"seed": run["seed"], "selected_step": run["selected_step"],
            "dev_final": final["metrics"]["dev"][MEASURE], "dev_selected": run["dev"][MEASURE],
            "test_final": final["metrics"]["test"][MEASURE],
            "test_selected": run["test"][MEASURE],
            "checkpoints_evaluated": len(run["refreshes"]),
            "negatives_steps": stale["negatives_steps"],
            "negatives_trained_on": len(stale["negatives_steps"]),
            "staleness": stale["mean"], "ann_steps": stale["ann_steps"],
            "warmup_steps": stale["warmup_steps"], "minutes": run["minutes"]}


# ------------------------------------------------------------------------- per interval

STATS = ("dev_final", "dev_selected", "test_final", "test_selected", "checkpoints_evaluated",
         "negatives_trained_on", "staleness", "warmup_steps", "minutes")


def group(loaded: list[tuple[Path, dict]]) -> dict[int, dict]:
    """Runs by ``config.training.refresh_every`` and seed: the per-seed rows, the files, and
    the mean ± sd over seeds. Each (interval, seed) once; every interval the same seeds."""
    intervals: dict[int, dict] = {}
    origin: dict[tuple[int, int], Path] = {}
    for path, report in loaded:
        for run in report["runs"]:
            interval = run["config"]["training"]["refresh_every"]
            key = (interval, run["seed"])
            if key in origin:
                raise SystemExit(f"{path}: refresh_every {interval} seed {run['seed']} is "
                                 f"also in {origin[key]}; each interval and seed once")
            origin[key] = path
            entry = intervals.setdefault(interval, {"refresh_every": interval, "files": [],
                                                    "runs": []})
            if str(path) not in entry["files"]:
                entry["files"].append(str(path))
            entry["runs"].append(run_summary(path, run))
    seed_sets = {interval: sorted(r["seed"] for r in e["runs"])
                 for interval, e in intervals.items()}
    first = next(iter(seed_sets))
    for interval, seeds in seed_sets.items():
        if seeds != seed_sets[first]:
            raise SystemExit(f"{intervals[interval]['files'][0]}: seed values {seeds} at "
                             f"refresh_every {interval}, {seed_sets[first]} at refresh_every "
                             f"{first} ({intervals[first]['files'][0]}); pairing needs the "
                             "same seeds")
    for entry in intervals.values():
        entry["runs"].sort(key=lambda r: r["seed"])
        entry["seeds"] = [r["seed"] for r in entry["runs"]]
        entry["stats"] = {name: mean_std([r[name] for r in entry["runs"]])
                          for name in STATS
                          if all(r[name] is not None for r in entry["runs"])}
    return dict(sorted(intervals.items()))


def paired(intervals: dict[int, dict], baseline: int) -> list[dict]:
    """Per interval other than ``baseline``: dev nDCG@10 minus the baseline's, seed by seed,
    at the final and at the dev-selected checkpoint, with mean, min and max over seeds."""
    base = {r["seed"]: r for r in intervals[baseline]["runs"]}
    rows = []
    for interval, entry in intervals.items():
        if interval == baseline:
            continue
        row: dict = {"refresh_every": interval, "baseline": baseline,
                     "seeds": entry["seeds"]}
        for checkpoint in ("final", "selected"):
            deltas = {r["seed"]: r[f"dev_{checkpoint}"] - base[r["seed"]][f"dev_{checkpoint}"]
                      for r in entry["runs"]}
            row[checkpoint] = {"per_seed": {str(s): d for s, d in deltas.items()},
                               "mean": statistics.fmean(deltas.values()),
                               "min": min(deltas.values()), "max": max(deltas.values())}
        rows.append(row)
    return rows


def decide(intervals: dict[int, dict], pairs: list[dict], baseline: int) -> dict:
    """``RULE``: the highest mean dev-selected nDCG@10 wins if it beats the baseline on every
    seed (paired); else the baseline stays. Ties of the mean go to the baseline."""
    winner = max(intervals, key=lambda i: (intervals[i]["stats"]["dev_selected"]["mean"],
                                           i == baseline))
    seeds = len(intervals[baseline]["seeds"])
    means = ", ".join(f"{i}: {e['stats']['dev_selected']['mean']:.4f}"
                      for i, e in intervals.items())
    if winner == baseline:
        default = baseline
        reason = (f"refresh_every {baseline} (the baseline) has the highest mean dev nDCG@10 "
                  f"at the dev-selected checkpoint ({means}); it stays the default")
    else:
        gains = next(p for p in pairs if p["refresh_every"] == winner)["selected"]
        if all(d > 0 for d in gains["per_seed"].values()):
            default = winner
            reason = (f"refresh_every {winner} has the highest mean dev nDCG@10 at the "
                      f"dev-selected checkpoint ({means}) and gains over {baseline} on every "
                      f"seed ({gains['min']:+.4f} to {gains['max']:+.4f}, mean "
                      f"{gains['mean']:+.4f}); it becomes the default")
        else:
            default = baseline
            reason = (f"refresh_every {winner} has the highest mean dev nDCG@10 at the "
                      f"dev-selected checkpoint ({means}) but its paired gain over "
                      f"{baseline} is not positive on every seed ({gains['min']:+.4f} to "
                      f"{gains['max']:+.4f}, mean {gains['mean']:+.4f}): not separable from "
                      f"noise at {seeds} seeds; refresh_every {baseline} stays the default")
    return {"rule": RULE, "winner_by_mean": winner, "default": default,
            "changed": default != baseline, "reason": reason}


# ------------------------------------------------------------------------------- output


def _rel(path: Path) -> str:
    resolved = path.resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(path)


def summarise(paths: list[Path], baseline: int) -> dict:
    loaded = [(Path(_rel(path)), json.loads(path.read_text())) for path in paths]
    check_comparable(loaded)
    intervals = group(loaded)
    if baseline not in intervals:
        raise SystemExit(f"--baseline {baseline}: no report has training.refresh_every "
                         f"{baseline} (found {sorted(intervals)})")
    pairs = paired(intervals, baseline)
    first = loaded[0][1]["runs"][0]
    return {"command": command_line(), "date": utc_now(), "method": first["method"],
            "data": first["config"]["data"]["path"],
            "budget": budget_of(first["config"]), "baseline": baseline,
            "reports": [{"file": str(path), "command": report.get("command"),
                         "date": report.get("date"), "machine": report.get("machine")}
                        for path, report in loaded],
            "intervals": list(intervals.values()), "paired": pairs,
            "decision": decide(intervals, pairs, baseline), "note": NOTE_SELECTION}


def _num(value: float | None, digits: int = 4) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _stat(stats: dict, name: str, digits: int = 4) -> str:
    """``mean ± sd`` of ``stats[name]``; – where a seed had no value (no ANN step)."""
    if name not in stats:
        return "–"
    return f"{stats[name]['mean']:.{digits}f} ± {stats[name]['std']:.{digits}f}"


def render(report: dict) -> str:
    decision = report["decision"]
    machines = list(dict.fromkeys(machine_line(r["machine"]) for r in report["reports"]))
    lines = [
        "# Refresh interval at a fixed budget (issue 31, item 3)", "",
        f"Does a shorter `training.refresh_every` (fresher ANN negatives: ANCE, arXiv:2007.00808,"
        f" §4 and §6.4) help on dev at the same budget? Method `{report['method']}`, data "
        f"`{report['data']}`, baseline refresh_every {report['baseline']}.", "",
        f"Command: `{report['command']}`", "",
        "Machine: " + "; ".join(machines), "",
        "Reports: " + "; ".join(f"`{r['file']}` ({r['date']}): `{r['command']}`"
                                for r in report["reports"]), "",
        f"Budget (the same for every run but refresh_every and the seed): "
        f"`{json.dumps(report['budget'])}`", "",
        "nDCG@10 at the final checkpoint (step = training.steps) and at the checkpoint "
        "selected on dev; test is reported, never used to decide. Checkpoints: evaluated, "
        "the zero-shot one included. Negatives: the checkpoints whose mined negatives were "
        "trained on. Staleness: mean over the training steps on ANN negatives of the step "
        "minus the checkpoint the negatives were mined from; warm-up: steps on BM25 negatives "
        "(or none) before the first ANN table. Mean ± sample sd over seeds.", ""]
    for entry in report["intervals"]:
        stats = entry["stats"]
        lines += [f"## refresh_every {entry['refresh_every']}"
                  + (" (baseline)" if entry["refresh_every"] == report["baseline"] else ""), "",
                  "Files: " + ", ".join(f"`{f}`" for f in entry["files"]), "",
                  "| seed | dev final | dev selected (checkpoint) | test final | test selected "
                  "| checkpoints | negatives trained on | warm-up steps | staleness (steps) "
                  "| minutes |", "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
        for run in entry["runs"]:
            lines.append(
                f"| {run['seed']} | {run['dev_final']:.4f} | {run['dev_selected']:.4f} "
                f"({run['selected_step']}) | {run['test_final']:.4f} | "
                f"{run['test_selected']:.4f} | {run['checkpoints_evaluated']} | "
                f"{run['negatives_trained_on']}: {run['negatives_steps']} | "
                f"{run['warmup_steps']} | {_num(run['staleness'], 1)} | "
                f"{run['minutes']:.1f} |")
        lines += [f"| mean ± sd | {_stat(stats, 'dev_final')} | {_stat(stats, 'dev_selected')} "
                  f"| {_stat(stats, 'test_final')} | {_stat(stats, 'test_selected')} | "
                  f"{_stat(stats, 'checkpoints_evaluated', 1)} | "
                  f"{_stat(stats, 'negatives_trained_on', 1)} | "
                  f"{_stat(stats, 'warmup_steps', 1)} | {_stat(stats, 'staleness', 1)} | "
                  f"{_stat(stats, 'minutes', 1)} |", ""]
    seeds = report["intervals"][0]["seeds"]
    lines += [f"## Paired differences of dev nDCG@10 against refresh_every {report['baseline']}",
              "", "| refresh_every | checkpoint | " + " | ".join(f"seed {s}" for s in seeds)
              + " | mean | min | max |", "|---|---|" + "---:|" * (len(seeds) + 3)]
    for pair in report["paired"]:
        for checkpoint in ("final", "selected"):
            delta = pair[checkpoint]
            lines.append(f"| {pair['refresh_every']} | {checkpoint} | "
                         + " | ".join(f"{delta['per_seed'][str(s)]:+.4f}" for s in seeds)
                         + f" | {delta['mean']:+.4f} | {delta['min']:+.4f} | "
                           f"{delta['max']:+.4f} |")
    if not report["paired"]:
        lines.append("| – | – |" + " – |" * (len(seeds) + 3))
    lines += ["", report["note"], "",
              f"Rule: {decision['rule']}.", "",
              f"**Decision: {decision['reason']}.**", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = summarise(args.reports, args.baseline)
    write_report(args.out, args.name, report, render(report))
    return 0
