"""The refresh timeline of the quickstart configuration on a SciFact slice, drawn and tabled.

Each variant is one embedded run (``EmbeddedRun``: redis-server, trainer, 2 inferencers,
indexer as OS processes) of ``configs/quickstart.yaml`` with the data cut to the first
``--docs`` SciFact documents (and the queries whose positives lie among them), ``--steps``
training steps and a refresh every ``--refresh-every`` steps. After the run the timeline of
every refresh is read back from the store (:func:`ance_train.observability.timeline.run_timelines`:
``eval/<k>.json`` + ``trainer/summary.json``).

Variants (one invocation runs them one after the other on the same machine, each in a
process of its own, with the same configuration and data):

- ``before``: the code of ``--before-rev`` (default ``HEAD``, the last commit without this
  working tree's changes), unpacked by ``git archive`` into a temporary directory and put
  first on the run's ``PYTHONPATH``, launcher and services alike;
- ``after``: this working tree.

    python bench/refresh_timeline.py --docs 1000 --steps 30 --refresh-every 10

``--from-json FILE`` redraws the table and the figure from an earlier report. Writes
``refresh-timeline.json`` / ``.md`` / ``.png``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import yaml

from ance_train.config import load_config
from ance_train.launcher.embedded import EmbeddedRun
from ance_train.observability.timeline import PHASE_NAMES, check_order, run_timelines

from ance_train_dev.helpers import make_scifact_subset
from ance_train_dev.report import (
    DEFAULT_MODEL,
    command_line,
    machine,
    model_directory,
    utc_now,
    write_report,
)

REPO = Path(__file__).resolve().parents[1]

VARIANTS = ("before", "after")
# Inferencer rows: drawn shard by shard (the times of shard.encoded that bound them).
SHARD_PHASES = {"model load": ("claimed_at", "loaded_at"),
                "tokenize": ("loaded_at", "tokenized_at"),
                "encode": ("tokenized_at", "encoded_at"),
                "shard upload": ("upload_started_at", "finished_at")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, type=model_directory)
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared/data/scifact")
    parser.add_argument("--docs", type=int, default=1000, help="first N SciFact documents")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--refresh-every", type=int, default=10)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--before-rev", default="HEAD",
                        help="the git revision whose code the before variant runs")
    parser.add_argument("--max-minutes", type=float, default=15.0, help="per run")
    parser.add_argument("--from-json", type=Path, help="redraw from this report")
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks")
    # One variant's run, in a process of its own (what the parent starts).
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--slice", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def unpack_revision(rev: str, directory: Path) -> str:
    """``src/`` of git revision ``rev`` into ``directory``; returns the commit it names."""
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=REPO,
                            check=True, capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "archive", "--format=tar", commit, "src"], cwd=REPO,
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(directory, filter="data")
    return commit


def run_variant(args: argparse.Namespace, data: Path, root: Path, variant: str,
                code: Path | None) -> dict:
    """Run ``variant`` in a child process, its code from ``code`` (None: this tree)."""
    result = root / f"{variant}.json"
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(code / "src"), *filter(None, [env.get("PYTHONPATH")])])
    subprocess.run([sys.executable, __file__, "--worker", variant, "--slice", str(data),
                    "--work", str(root), "--result", str(result), "--model", args.model,
                    "--docs", str(args.docs), "--steps", str(args.steps),
                    "--refresh-every", str(args.refresh_every),
                    "--max-minutes", str(args.max_minutes)], env=env, check=True)
    return json.loads(result.read_text())


def worker(args: argparse.Namespace) -> int:
    """One variant's run (in the code this process imported), its result as JSON."""
    import ance_train

    print(f"{args.worker}: ance_train from {Path(ance_train.__file__).parent}",
          file=sys.stderr)
    run = one_run(args, args.slice, args.work, args.worker)
    args.result.write_text(json.dumps(run))
    return 0


def run_config(args: argparse.Namespace, data: Path, root: Path, variant: str) -> dict:
    config = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
    config.update(run_id=f"timeline-{variant}", output_dir=str(root))
    config["data"] = {**config["data"], "path": str(data)}
    config["model"] = {**config.get("model", {}), "path": args.model}
    config["training"] = {**config["training"], "steps": args.steps,
                          "refresh_every": args.refresh_every}
    return config


def one_run(args: argparse.Namespace, data: Path, root: Path, variant: str) -> dict:
    config_path = root / f"{variant}.yaml"
    config_path.write_text(yaml.safe_dump(run_config(args, data, root, variant)))
    config = load_config(config_path)
    load_before = os.getloadavg()
    run = EmbeddedRun(config, config_path, overwrite=True, max_minutes=args.max_minutes)
    run.prepare()
    try:
        run.start_services()
        result = run.monitor()
        timelines = run_timelines(run.store, result.trainer_summary)
    finally:
        run.stop()
    return {"variant": variant, "timelines": timelines, "run_seconds": result.seconds,
            "corpus_docs": run.dataset.num_docs,
            "load_average_before": load_before, "load_average_after": os.getloadavg()}


def phase_seconds(timeline: dict) -> dict[str, float]:
    return {row["phase"]: row["seconds"] for row in timeline["rows"]}


def summarise(run: dict) -> dict:
    """Medians over the refreshes after the zero-shot one (checkpoint 0 runs in processes
    that start cold) that the trainer swapped in."""
    later = [t for t in run["timelines"] if t["step"] > 0 and t["swapped"]]
    if not later:
        later = [t for t in run["timelines"] if t["step"] > 0]
    phases = {name: statistics.median(phase_seconds(t).get(name, 0.0) for t in later)
              for name in PHASE_NAMES}
    busy = {row["phase"]: statistics.median(
        next((r.get("busy_s", r["seconds"]) for r in t["rows"] if r["phase"] == row["phase"]),
             0.0) for t in later)
        for row in later[0]["rows"] if "busy_s" in row} if later else {}
    return {
        "refreshes": [t["step"] for t in later],
        "fixed_s": statistics.median(t["fixed_s"] for t in later),
        "fixed_s_each": [round(t["fixed_s"], 3) for t in later],
        "period_s": statistics.median(t["period_s"] for t in later),
        "encode_union_s": statistics.median(t["encode_union_s"] for t in later),
        "search_s": statistics.median(t["search_s"] for t in later),
        "phases_s": phases,
        "busy_s": busy,
        "order_problems": {t["step"]: check_order(t) for t in run["timelines"]
                           if check_order(t)},
        "model_reloads": {t["step"]: sum(bool(s["model_reloaded"]) for s in t["shards"])
                          for t in run["timelines"]},
        "tokens_cached": {t["step"]: sum(bool(s["tokens_cached"]) for s in t["shards"])
                          for t in run["timelines"]},
    }


def render(report: dict) -> str:
    m, p = report["machine"], report["params"]
    runs = report["runs"]
    names = [r["variant"] for r in runs]
    summary = report["summary"]
    lines = [
        "# Refresh timeline (quickstart configuration, SciFact slice, CPU)", "",
        f"Command: `{report['command']}`", "",
        f"Machine: {m['cpu']} — {m['cores']} cores, flags {', '.join(m['cpu_flags'])}; "
        f"torch {m['torch']}; {report['date']}. Load average (1 min) before/after each run: "
        + ", ".join(f"{r['variant']} {r['load_average_before'][0]:.1f}/"
                    f"{r['load_average_after'][0]:.1f}" for r in runs), "",
        f"Params: `configs/quickstart.yaml` with {runs[0]['corpus_docs']} documents, "
        f"{p['steps']} steps, a refresh every {p['refresh_every']}; model `{p['model']}`. "
        "Times are Unix wall-clock times of each process (one machine: one clock). Medians "
        "over the refreshes after the zero-shot one that the trainer swapped in "
        "(" + ", ".join(f"{n}: {summary[n]['refreshes']}" for n in names) + ").", "",
        *([("Code: " + "; ".join(f"{n}: {p['code'][n]}" for n in names if n in p["code"])
            + "."), ""] if p.get("code") else []),
        "**Fixed part** = the refresh (trainer's save starts → table swapped in by the "
        "trainer's feed) − the time some replica was encoding (union of the shards' encode "
        "intervals) − the index searches:", "",
        "| | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
        "| **fixed part (s)** | " + " | ".join(f"**{summary[n]['fixed_s']:.2f}**"
                                              for n in names) + " |",
        "| fixed part of each refresh (s) | " + " | ".join(
            ", ".join(f"{x:.2f}" for x in summary[n]["fixed_s_each"]) for n in names) + " |",
        "| refresh period (s) | " + " | ".join(f"{summary[n]['period_s']:.2f}"
                                             for n in names) + " |",
        "| encoding, union over replicas (s) | " + " | ".join(
            f"{summary[n]['encode_union_s']:.2f}" for n in names) + " |",
        "| index searches (s) | " + " | ".join(f"{summary[n]['search_s']:.3f}"
                                             for n in names) + " |",
        "| whole run (s) | " + " | ".join(f"{r['run_seconds']:.0f}" for r in runs) + " |",
        "",
        "Each row of the timeline, median seconds (inferencer rows: first shard's start → "
        "last shard's end; in brackets the sum over shards, replicas in parallel):", "",
        "| row | role | " + " | ".join(names) + " |",
        "|---|---|" + "---:|" * len(names),
    ]
    roles = dict((row["phase"], row["role"]) for r in runs for t in r["timelines"]
                 for row in t["rows"])
    for phase in PHASE_NAMES:
        cells = []
        for n in names:
            value = summary[n]["phases_s"].get(phase, 0.0)
            busy = summary[n]["busy_s"].get(phase)
            cells.append(f"{value:.3f}" + (f" ({busy:.2f})" if busy is not None else ""))
        lines.append(f"| {phase} | {roles.get(phase, '')} | " + " | ".join(cells) + " |")
    for n in names:
        s = summary[n]
        lines.append("")
        lines.append(f"{n}: shards whose replica built the model from scratch, per refresh "
                     f"{s['model_reloads']}; shards whose token ids were cached "
                     f"{s['tokens_cached']}; rows out of order: {s['order_problems'] or 'none'}.")
    return "\n".join(lines) + "\n"


def plot(report: dict, out: Path) -> str:
    """A Gantt chart of one refresh per variant (the median refresh by period); inferencer
    rows show each shard's interval over the span from the first shard's start to the last
    one's end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 3.2 * len(runs)), squeeze=False)
    colours = {"trainer": "tab:blue", "inferencer": "tab:green", "indexer": "tab:orange",
               "wait": "lightgrey"}
    for ax, run in zip(axes[:, 0], runs, strict=True):
        later = [t for t in run["timelines"] if t["step"] > 0] or run["timelines"]
        timeline = sorted(later, key=lambda t: t["period_s"])[len(later) // 2]
        origin = timeline["milestones"]["save_started"]
        rows = timeline["rows"]
        for y, row in enumerate(rows):
            if row["phase"] in SHARD_PHASES:  # each shard's own interval, over a faint span
                ax.barh(y, row["seconds"], left=row["start"] - origin, color="honeydew")
                begin, end = SHARD_PHASES[row["phase"]]
                for shard in timeline["shards"]:
                    ax.barh(y, max(shard[end] - shard[begin], 0.002),
                            left=shard[begin] - origin, height=0.5, color=colours["inferencer"])
            else:
                ax.barh(y, max(row["seconds"], 0.002), left=row["start"] - origin,
                        color=colours[row["role"]])
        ax.set_yticks(range(len(rows)), [r["phase"] for r in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("seconds since the trainer started saving the checkpoint")
        ax.set_title(f"{run['variant']}: refresh of checkpoint {timeline['step']} — period "
                     f"{timeline['period_s']:.1f} s, fixed part {timeline['fixed_s']:.2f} s",
                     fontsize=9)
    fig.tight_layout()
    name = "refresh-timeline.png"
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if args.from_json:
        report = json.loads(args.from_json.read_text())
    else:
        runs = []
        code: dict[str, str] = {"after": "this working tree"}
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            data = make_scifact_subset(root / "scifact-slice", max_docs=args.docs,
                                       max_queries=10_000)
            before = None
            if "before" in args.variants:
                before = root / "before-code"
                commit = unpack_revision(args.before_rev, before)
                code["before"] = f"{args.before_rev} ({commit})"
            for variant in args.variants:
                run = run_variant(args, data, root, variant,
                                  before if variant == "before" else None)
                runs.append(run)
                print(f"{variant}: " + ", ".join(
                    f"refresh {t['step']} fixed {t['fixed_s']:.2f}s" for t in run["timelines"]),
                    file=sys.stderr)
        report = {
            "command": command_line(), "date": utc_now(), "machine": machine("cpu"),
            "params": {"model": args.model, "docs": args.docs, "steps": args.steps,
                       "refresh_every": args.refresh_every, "variants": args.variants,
                       "code": code},
            "summary": {run["variant"]: summarise(run) for run in runs},
            "runs": runs,
        }
    args.out.mkdir(parents=True, exist_ok=True)
    image = plot(report, args.out)
    write_report(args.out, "refresh-timeline", report,
                 render(report) + f"\n![refresh timeline]({image})\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
