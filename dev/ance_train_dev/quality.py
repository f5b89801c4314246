"""Retrieval quality on SciFact (or NFCorpus): does each method help? Measured through the real
services, against the sentence-transformers recipe a user would run instead.

Every method of ``configs/methods/`` is trained with the same budget (steps, batch size,
learning-rate schedule, refresh interval, sequence lengths: the profile's) by the embedded
run (``ance-train run``: trainer, inferencers and indexer as processes). For each run the
checkpoint with the best **dev** nDCG@10 (the official dev qrels, or a slice held out of
train when the dataset has none) is selected, and the **test** split is reported for that
checkpoint only. References: BM25 (bm25s, k1=0.9, b=0.4 as in BEIR/Anserini) and zero-shot
(checkpoint 0 of every run: the pretrained model, evaluated by the same indexer code).

    python bench/quality.py --profile cpu               # ≤ 60 min on 2 CPU cores
    python bench/quality.py --profile cpu-long --methods ance st-static   # 300 steps
    python bench/quality.py --profile gpu --seeds 13 42 77

Writes ``quality-<profile>.json``, ``quality-<profile>.md`` and plots (test nDCG@10 per
refresh, training loss, forgetting rate; mean ± std over seeds) into ``--out`` (default
docs/benchmarks). ``--runs-dir`` keeps every run's embeddings, negatives tables, logs and
summary (about 40 MB each on the cpu profile) so that ``bench/significance.py`` and
``bench/negative_hardness.py`` can analyse them; ``--keep-checkpoints`` keeps the model
checkpoints and the services' work directories as well (about 1.3 GB per run). Without
``--runs-dir`` the runs go to a temporary directory. Rerunning a command with the same
``--runs-dir`` reuses every run that already finished there with the same config, so an
invocation that failed or was stopped loses none of its finished runs (``--retrain`` to
train them again).

A variant of a method (``--set negatives.top_k=20``) gets its own name with ``--label
ance-top20``; ``--combine`` then merges it beside the method itself, and
``bench/significance.py`` compares it with the baselines too (the false-negative filter:
``--methods ance --set negatives.max_positive_ratio=0.95 --label ance-perc95``).

``st-static`` is the peer a user would run instead: sentence-transformers, hard negatives
mined once by the zero-shot model, MultipleNegativesRankingLoss, with the same split, budget,
checkpoints and evaluation (``dev/ance_train_dev/peer_sentence_transformers.py``);
``bench/significance.py --reference st-static`` compares every row with it. ``--data nfcorpus``
runs on NFCorpus, whose official dev qrels are the dev split. The exact commands of the runs
against the peer (SciFact and NFCorpus, 60 steps, 3 seeds) are in docs/benchmarks/quality-peer.md:

    python bench/quality.py --profile cpu --steps 60 --methods st-static --seeds 13 \
        --name long60-st-static-s13 --out docs/benchmarks/quality-cpu-60-parts \
        --runs-dir runs/long60
    python bench/quality.py --profile cpu --steps 60 --data nfcorpus --methods ance \
        --seeds 13 --name nfc60-ance-s13 --out docs/benchmarks/quality-cpu-60-nfcorpus-parts \
        --runs-dir runs/nfc60
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from ance_train.config import apply_overrides, parse_override
from ance_train.data.dataset import DatasetIndex
from ance_train.protocol import keys
from ance_train.protocol.selection import (
    DevPoint,
    best_step,
    earliest_within_noise,
    interval,
    latest_within_noise,
    select_on_dev,
)

from ance_train_dev.report import command_line, machine, utc_now, write_report

REPO = Path(__file__).resolve().parents[2]
METHODS_DIR = REPO / "configs" / "methods"
# The peer a user would run instead (dev/ance_train_dev/peer_sentence_transformers.py): sentence-
# transformers, hard negatives mined once by the zero-shot model, MNRL. Not a method of this
# system, so it has no file in configs/methods/: it gets ance.yaml's data and model settings.
PEER = "st-static"
ALL_METHODS = ["in-batch", "random", "bm25", "bm25-random", "ance", "simans", "ance-tele",
               "dance", PEER]
# Datasets by name (--data NAME); --data also takes any BEIR directory.
DATASETS = {"scifact": REPO.parent / "shared/data/scifact",
            "nfcorpus": REPO.parent / "shared/data/nfcorpus"}
REPORTED = ("ndcg@10", "mrr@10", "recall@100")

# The shared budget of every method. `cpu` is reduced to fit 60 minutes on 2 cores: shorter
# documents (128 tokens), 30 steps, one seed, and four methods per invocation; `gpu` is the
# full comparison. The learning rate 5e-5 won on dev (docs/benchmarks/tuning/).
PROFILES: dict[str, dict] = {
    "cpu": {"training": {"steps": 30, "batch_size": 16, "learning_rate": 5e-5,
                         "warmup_steps": 3, "refresh_every": 15, "torch_threads": 1},
            "model": {"max_query_length": 48, "max_doc_length": 128},
            "inference": {"replicas": 2, "shard_size": 500, "batch_size": 32,
                          "torch_threads": 1},
            "seeds": [13]},
    # The longer CPU budget of issue 16: 300 steps (4,800 queries, about 6.6 epochs of
    # SciFact's 728), six refreshes after zero-shot; about 25 min a run on the 2-core
    # AVX512-BF16 machine, 1 h without bf16.
    "cpu-long": {"training": {"steps": 300, "batch_size": 16, "learning_rate": 5e-5,
                              "warmup_steps": 30, "refresh_every": 50, "torch_threads": 1},
                 "model": {"max_query_length": 48, "max_doc_length": 128},
                 "inference": {"replicas": 2, "shard_size": 500, "batch_size": 32,
                               "torch_threads": 1},
                 "seeds": [13, 42, 77]},
    # One GPU: 64 queries a step and 256 document tokens, 400 steps (25,600 queries, about 35
    # epochs of SciFact's 728, 10 of NFCorpus's 2,590), a refresh every 50 steps (eight after
    # zero-shot). The first draft's 2,000 steps with a refresh every 250 were 176 SciFact
    # epochs with the first ANN negatives after 22 of them. Two CPU threads per process: the
    # benchmark runs several methods at once on one GPU machine (docs/benchmarks/quality-gpu.md).
    "gpu": {"training": {"steps": 400, "batch_size": 64, "learning_rate": 2e-5,
                         "warmup_steps": 40, "refresh_every": 50, "torch_threads": 2},
            "model": {"max_query_length": 64, "max_doc_length": 256},
            "inference": {"replicas": 1, "shard_size": 1000, "batch_size": 256,
                          "torch_threads": 2},
            "seeds": [13, 42, 77]},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    parser.add_argument("--methods", nargs="+", default=ALL_METHODS)
    parser.add_argument("--seeds", nargs="+", type=int, help="Override the profile's seeds.")
    parser.add_argument("--data", default="scifact",
                        help=f"A dataset name ({', '.join(DATASETS)}: ../shared/data/NAME) or "
                             "a BEIR directory. Its official qrels/dev.tsv, when it has one "
                             "(NFCorpus), is the dev split (data.dev_split: auto); else the dev "
                             "slice is cut from train (SciFact).")
    parser.add_argument("--train-queries", type=int, metavar="N",
                        help="Cut the training set to N queries with a positive, drawn with "
                             "--cut-seed (a small-data proxy, issue 33); dev and test stay. "
                             "Where the dev slice is cut from train (SciFact), it is cut from "
                             "these N, as it would be for a user who has only N.")
    parser.add_argument("--cut-seed", type=int, default=0,
                        help="Seed of --train-queries' draw (fixed apart from the training "
                             "seeds, so every seed trains on the same N queries).")
    parser.add_argument("--model", help="Encoder directory (default: the MiniLM package).")
    parser.add_argument("--steps", type=int, help="Override the profile's steps (tests).")
    parser.add_argument("--refresh-every", type=int, help="Override the refresh interval.")
    parser.add_argument("--max-doc-length", type=int, help="Override the document length.")
    parser.add_argument(
        "--select", choices=SELECTION_RULES, default="auto",
        help="Which checkpoint of a run is reported: auto (the default: what ance-train "
             "export --checkpoint best picks, protocol/selection.py: best, or "
             "latest-within-noise where dev has fewer than 50 queries), best (the highest dev "
             "nDCG@10), earliest-within-noise / latest-within-noise (the earliest / latest "
             "whose dev nDCG@10 reaches the lower end of the best's bootstrap 95%% interval, "
             "eval reports' ci95) or last. bench/interpolation.py --heldout-data scores the "
             "rules on a cut's held-out training queries.")
    parser.add_argument("--runs-dir", type=Path, help="Where runs go (default: a temp dir).")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="With --runs-dir: keep model checkpoints and work directories too "
                             "(default: only what the analyses read, about 40 MB per run).")
    parser.add_argument("--retrain", action="store_true",
                        help="Train every run again, even one that already finished in "
                             "--runs-dir with the same config (default: reuse it).")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    parser.add_argument("--max-minutes-per-run", type=float, default=30.0)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.FIELD=VALUE",
                        help="Override a config field for every method (dev tuning), e.g. "
                             "--set training.learning_rate=5e-5, or a strategy's setting, "
                             "--set negatives.simans.a=0.3; repeatable.")
    parser.add_argument("--label", help="Name the method LABEL in the report (one method per "
                             "invocation): a variant made with --set negatives.* can then be "
                             "merged by --combine beside the method itself, e.g. "
                             "--methods ance --set negatives.top_k=20 --label ance-top20.")
    parser.add_argument("--name", help="Output file stem (default quality-<profile>).")
    parser.add_argument("--combine", nargs="+", type=Path, metavar="REPORT_JSON",
                        help="Train nothing: merge the reports of several invocations (e.g. "
                             "four methods each, to fit the cpu budget) into one table/plots.")
    args = parser.parse_args(argv)
    args.dataset = args.data if args.data in DATASETS else Path(args.data).name
    args.data = DATASETS.get(args.data, Path(args.data))
    unknown = sorted(set(args.methods) - set(ALL_METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {ALL_METHODS}")
    for override in args.overrides:
        try:
            keys, _ = parse_override(override)  # the package's --set (ance-train run --set)
        except ValueError as error:
            parser.error(str(error))
        if len(keys) < 2:  # run_id and output_dir are the benchmark's own
            parser.error(f"--set {override!r}: expected SECTION.FIELD=VALUE "
                         "(or SECTION.SUBSECTION.FIELD=VALUE)")
    if args.max_doc_length:  # recorded with the run, as a variant's other settings are
        args.overrides.append(f"model.max_doc_length={args.max_doc_length}")
    if args.train_queries is not None:
        if args.train_queries < 2:
            parser.error("--train-queries must be at least 2")
        args.dataset = f"{args.dataset}-train{args.train_queries}"
    if args.label and len(args.methods) != 1:
        parser.error(f"--label names one method; got --methods {' '.join(args.methods)}")
    if args.label in ALL_METHODS and args.label != args.methods[0]:
        parser.error(f"--label {args.label!r} is another method's name")
    return args


def method_config(method: str, seed: int, args: argparse.Namespace, runs_dir: Path) -> dict:
    """The method's own file with the profile's shared budget laid over it (the peer: ance's
    file, whose data and model settings it shares; its negatives section is not read)."""
    raw = yaml.safe_load((METHODS_DIR / f"{'ance' if method == PEER else method}.yaml")
                         .read_text())
    profile = PROFILES[args.profile]
    raw["run_id"] = f"{method}-s{seed}"
    raw["output_dir"] = str(runs_dir)
    raw["data"]["path"] = str(args.data.resolve())
    raw["training"] = {**raw.get("training", {}), **profile["training"], "seed": seed}
    raw["model"] = {**raw.get("model", {}), **profile["model"]}
    raw["inference"] = {**raw.get("inference", {}), **profile["inference"]}
    if args.model:
        raw["model"]["path"] = args.model
    if args.steps:
        raw["training"]["steps"] = args.steps
        raw["training"]["warmup_steps"] = max(1, args.steps // 10)
    if args.refresh_every:
        raw["training"]["refresh_every"] = args.refresh_every
    if args.max_doc_length:
        raw["model"]["max_doc_length"] = args.max_doc_length
    negatives = raw.setdefault("negatives", {})
    if negatives.get("warmup_steps"):  # BM25 → X: warm up for one refresh interval
        negatives["warmup_steps"] = min(raw["training"]["refresh_every"],
                                        raw["training"]["steps"] - 1)
    apply_overrides(raw, args.overrides)
    return raw


def cut_training_set(data: Path, n: int, seed: int, into: Path) -> Path:
    """A BEIR directory like ``data`` whose ``qrels/train.tsv`` keeps only ``n`` queries that
    have a positive, drawn with ``seed`` (sorted, then shuffled, so the draw does not depend on
    the file's order). The corpus, queries and the other qrels are linked, not copied. Made
    once per (dataset, n, seed); a directory already there is reused."""
    target = into / f"{data.name}-train{n}-cut{seed}"
    if (target / "qrels" / "train.tsv").is_file():
        return target
    lines = (data / "qrels" / "train.tsv").read_text().splitlines()
    header, rows = lines[0], [line.split("\t") for line in lines[1:] if line.strip()]
    positive = sorted({row[0] for row in rows if float(row[2]) > 0})
    if len(positive) < n:
        raise SystemExit(f"--train-queries {n}: {data / 'qrels' / 'train.tsv'} has only "
                         f"{len(positive)} queries with a positive")
    random.Random(seed).shuffle(positive)
    keep = set(positive[:n])
    # A staging name of this process's own: parallel lanes (bench/quality_lanes.sh) cut the
    # same dataset at once, and the first rename wins.
    staging = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "qrels").mkdir(parents=True)
    for item in data.iterdir():
        if item.name != "qrels":
            (staging / item.name).symlink_to(item.resolve())
    for split in (data / "qrels").iterdir():
        if split.name != "train.tsv":
            (staging / "qrels" / split.name).symlink_to(split.resolve())
    kept = [header] + ["\t".join(row) for row in rows if row[0] in keep]
    (staging / "qrels" / "train.tsv").write_text("\n".join(kept) + "\n")
    try:
        staging.rename(target)
    except OSError:  # another lane's identical cut landed first
        if not (target / "qrels" / "train.tsv").is_file():
            raise
        shutil.rmtree(staging)
    return target


def run_child(command: list[str]) -> subprocess.CompletedProcess:
    """Run ``ance-train run`` and, if this script is stopped (SIGTERM, Ctrl-C), stop it too:
    its launcher then stops the services it started, so nothing keeps running unseen."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = child.communicate()
    except BaseException:
        child.terminate()
        try:
            child.wait(timeout=120)
        except subprocess.TimeoutExpired:
            child.kill()
        raise
    return subprocess.CompletedProcess(command, child.returncode, stdout, stderr)


def prune_run(run_dir: Path, run_id: str) -> None:
    """Drop what no analysis reads: model checkpoints (about 90 MB each with the trainer's
    optimizer state) and the services' local caches. Embeddings, negatives tables,
    evaluations, logs and the summary stay."""
    shutil.rmtree(run_dir / "work", ignore_errors=True)
    shutil.rmtree(run_dir / "store" / run_id / "checkpoints", ignore_errors=True)


def finished_run(config: dict, config_path: Path, run_dir: Path) -> dict | None:
    """The summary of a run that already finished with exactly this config, if there is one
    (so rerunning an invocation that failed or was stopped retrains nothing it finished)."""
    summary_path = run_dir / "summary.json"
    if not (config_path.is_file() and summary_path.is_file()):
        return None
    if yaml.safe_load(config_path.read_text()) != config:
        return None
    summary = json.loads(summary_path.read_text())
    trainer = summary.get("trainer", {})
    budget = trainer.get("budget", {}).get("steps", config["training"].get("steps"))
    if not trainer.get("finished") or (trainer.get("steps") != budget
                                       and not trainer.get("stopped_early")):
        return None
    return summary


SELECTION_RULES = ("auto", "best", "earliest-within-noise", "latest-within-noise", "last")


def select_checkpoint(refreshes: list[dict], rule: str = "best",
                      measure: str = "ndcg@10", dev_queries: int | None = None) -> dict:
    """The refresh reported for a run, by dev ``measure`` (the rules are
    ``ance_train.protocol.selection``'s). ``auto``: what ``ance-train export --checkpoint
    best`` picks (``best``, or ``latest-within-noise`` when the dev split has fewer than
    ``MIN_DEV_QUERIES`` queries, ``dev_queries``). ``best``: the highest (the earliest of
    equals). ``earliest-within-noise`` / ``latest-within-noise``: the earliest / latest whose
    value reaches the lower end of the best's bootstrap 95% interval (``ci95`` of its eval
    report, ``evaluation.bootstrap_ci``), i.e. no worse than the best by more than the dev
    set's noise; the best itself when its report has no interval. ``last``: the last
    checkpoint, whatever dev says."""
    if rule not in SELECTION_RULES:
        raise ValueError(f"unknown selection rule {rule!r}: expected one of {SELECTION_RULES}")
    points = [DevPoint(r["step"], r["metrics"]["dev"][measure],
                       interval(r.get("ci95", {}).get("dev", {}).get(measure)))
              for r in refreshes]
    if rule == "last":
        step = max(p.step for p in points)
    elif rule == "auto":
        step = select_on_dev(points, dev_queries)
    elif rule == "best":
        step = best_step(points)
    elif rule == "latest-within-noise":
        step = latest_within_noise(points)
    else:
        step = earliest_within_noise(points)
    return next(r for r in refreshes if r["step"] == step)


def run_method(method: str, seed: int, args: argparse.Namespace, runs_dir: Path) -> dict:
    config = method_config(method, seed, args, runs_dir)
    config_path = runs_dir / f"{config['run_id']}.yaml"
    run_dir = runs_dir / config["run_id"]
    summary = None if args.retrain else finished_run(config, config_path, run_dir)
    if summary is not None:
        print(f"[quality] {method} seed {seed}: reusing the finished run {run_dir}", flush=True)
        minutes = summary["seconds"] / 60
    else:
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        started = time.monotonic()
        if method == PEER:
            from ance_train_dev.peer_sentence_transformers import train_peer

            shutil.rmtree(run_dir, ignore_errors=True)
            train_peer(config, run_dir)
        else:
            result = run_child([sys.executable, "-m", "ance_train.cli", "run", "--config",
                                str(config_path), "--overwrite", "--max-minutes",
                                str(args.max_minutes_per_run)])
            if result.returncode != 0:
                raise RuntimeError(f"{method} (seed {seed}) failed:\n{result.stdout[-3000:]}"
                                   f"\n{result.stderr[-3000:]}")
        summary = json.loads((run_dir / "summary.json").read_text())
        minutes = (time.monotonic() - started) / 60
    store = run_dir / "store" / config["run_id"] / "eval"
    refreshes = []
    for evaluation in summary["evaluations"]:
        stored = json.loads((store / f"{evaluation['step']}.json").read_text())
        refreshes.append({"step": evaluation["step"], "metrics": evaluation["metrics"],
                          "ci95": stored.get("ci95", {}),
                          "diagnostics": stored.get("diagnostics", {})})
    if not refreshes or refreshes[0]["step"] != 0:
        raise RuntimeError(f"{method} (seed {seed}): no evaluation of checkpoint 0 in "
                           f"{run_dir / 'summary.json'}; the zero-shot reference is missing")
    if not args.keep_checkpoints:
        prune_run(run_dir, config["run_id"])
    index = DatasetIndex.from_json((run_dir / "store" / config["run_id"] / keys.DATASET_INDEX)
                                   .read_text())
    best = select_checkpoint(refreshes, args.select, dev_queries=len(index.dev))
    trainer = summary["trainer"]
    return {"method": args.label or method, "base_method": method,
            "overrides": args.overrides, "seed": seed, "minutes": minutes,
            "selected_step": best["step"], "selection": args.select,
            "dev_queries": len(index.dev), "dev": best["metrics"]["dev"],
            "test": best["metrics"]["test"], "refreshes": refreshes,
            "losses": trainer["losses"], "swaps": trainer["swaps"],
            **({"peer": summary["peer"]} if "peer" in summary else {}),
            "config": config}


def bm25_runs(data: Path) -> tuple[dict, dict]:
    """bm25s with BEIR's k1=0.9, b=0.4: the top-1000 run and the qrels of dev and test."""
    from ance_train.config import DataConfig
    from ance_train.data.corpus import open_corpus
    from ance_train.data.validation import validate_dataset
    from ance_train.negatives.strategies.bm25 import bm25_index, bm25_rank

    method_data = yaml.safe_load((METHODS_DIR / "ance.yaml").read_text())["data"]
    cfg = DataConfig(**{**method_data, "path": str(data.resolve())})
    with tempfile.TemporaryDirectory() as cache:
        dataset = validate_dataset(cfg, Path(cache), seed=cfg.split_seed)
        corpus = open_corpus(cfg, cache)
        retriever = bm25_index([text for _, text in corpus.iter_range(0, len(corpus))],
                               k1=0.9, b=0.4)
        depth = min(1000, len(corpus))
    runs, qrels = {}, {}
    for split in ("dev", "test"):
        split_qrels = getattr(dataset, split)
        qids = sorted(split_qrels)
        ranked, scores = bm25_rank(retriever, [dataset.queries[q] for q in qids], depth)
        runs[split] = {q: {str(int(d)): float(s) for d, s in zip(r, sc, strict=True)}
                       for q, r, sc in zip(qids, ranked, scores, strict=True)}
        qrels[split] = {q: {str(d): rel for d, rel in rels.items()}
                        for q, rels in split_qrels.items()}
    return runs, qrels


def bm25_reference(args: argparse.Namespace) -> dict:
    """BM25's metrics on the same dev slice and the test split."""
    from ance_train.evaluation import evaluate

    runs, qrels = bm25_runs(args.data)
    return {split: evaluate(runs[split], qrels[split]) for split in runs}


def display_name(dataset: str) -> str:
    """``SciFact``, ``NFCorpus``; any other dataset by its directory name."""
    return {"scifact": "SciFact", "nfcorpus": "NFCorpus"}.get(dataset, dataset)


def mean_std(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}


def aggregate(runs: list[dict]) -> dict:
    by_method: dict[str, list[dict]] = {}
    for run in runs:
        by_method.setdefault(run["method"], []).append(run)
    return {method: {split: {name: mean_std([r[split][name] for r in method_runs])
                             for name in REPORTED} for split in ("dev", "test")}
            for method, method_runs in by_method.items()}


def labelled_variants(runs: list[dict]) -> dict[str, dict]:
    """Method name → the method and overrides it stands for, for every ``--label``ed one."""
    return {run["method"]: {"method": run["base_method"], "overrides": run["overrides"]}
            for run in runs if run.get("base_method", run["method"]) != run["method"]}


def render_markdown(report: dict) -> str:
    def cell(stats: dict) -> str:
        return (f"{stats['mean']:.4f} ± {stats['std']:.4f}" if stats["n"] > 1
                else f"{stats['mean']:.4f}")

    lines = [f"# Retrieval quality on {display_name(report.get('dataset', 'scifact'))} "
             f"({report['profile']} profile)", "",
             f"Command: `{report['command']}`", "",
             *([f"Merged by: `{report['merged_by']}`", ""] if report.get("merged_by") else []),
             f"Machine: {report['machine']['cpu']} — {report['machine']['cores']} cores, "
             f"GPU: {report['machine']['gpu'] or 'none'}, torch {report['machine']['torch']}; "
             f"{report['date']}; {report['minutes']:.1f} min in all", "",
             f"Budget per method: {json.dumps(report['budget'])}. Checkpoints selected on dev "
             "nDCG@10; test reported for the selected one (mean ± sample std over seeds).", "",
             "| method | seeds | selected checkpoint(s) | dev nDCG@10 | test nDCG@10 | "
             "test MRR@10 | test R@100 |", "|---|---|---|---:|---:|---:|---:|"]
    for name, ref in report["references"].items():
        lines.append(f"| {name} (reference) | – | – | {ref['dev']['ndcg@10']:.4f} | "
                     f"{ref['test']['ndcg@10']:.4f} | {ref['test']['mrr@10']:.4f} | "
                     f"{ref['test']['recall@100']:.4f} |")
    for method, stats in report["aggregate"].items():
        runs = [r for r in report["runs"] if r["method"] == method]
        seeds = ", ".join(str(r["seed"]) for r in runs)
        steps = ", ".join(str(r["selected_step"]) for r in runs)
        lines.append(f"| {method} | {seeds} | {steps} | {cell(stats['dev']['ndcg@10'])} | "
                     f"{cell(stats['test']['ndcg@10'])} | {cell(stats['test']['mrr@10'])} | "
                     f"{cell(stats['test']['recall@100'])} |")
    variants = report.get("variants") or {}
    if variants:
        lines += ["", "Variants: " + "; ".join(
            f"{label} = {v['method']}"
            + (f" with {', '.join(f'`{o}`' for o in v['overrides'])}" if v["overrides"] else "")
            for label, v in variants.items()) + "."]
    peer_runs = [r for r in report["runs"] if "peer" in r]
    if peer_runs:
        lines += ["", f"{PEER} (sentence-transformers, "
                      "dev/ance_train_dev/peer_sentence_transformers.py): "
                  + "; ".join(f"seed {r['seed']}: mining {r['peer']['mining_seconds'] / 60:.1f} "
                              f"min, training {r['peer']['training_seconds'] / 60:.1f} min, "
                              f"checkpoint evaluations {r['peer']['evaluation_seconds'] / 60:.1f}"
                              f" min, {r['peer']['triplets']} triplets, "
                              f"{r['peer']['threads']} threads" for r in peer_runs) + "."]
    lines += ["", "Plots: " + ", ".join(f"`{p}`" for p in report["plots"]), ""]
    return "\n".join(lines)


def mean_over_seeds(series: list[tuple[list, list]]) -> tuple[list, np.ndarray, np.ndarray]:
    """Mean and standard deviation over seeds at the x values every seed has (a refresh can
    be overtaken in one seed's run and not in another's)."""
    points = [dict(zip(xs, ys, strict=True)) for xs, ys in series]
    xs = sorted(set.intersection(*(set(p) for p in points)))
    values = np.array([[p[x] for x in xs] for p in points], dtype=float).reshape(len(points),
                                                                                 len(xs))
    return xs, values.mean(axis=0), values.std(axis=0)


def plot(report: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    panels = [("test-ndcg", "test nDCG@10 per refresh",
               lambda r: ([x["step"] for x in r["refreshes"]],
                          [x["metrics"]["test"]["ndcg@10"] for x in r["refreshes"]])),
              ("loss", "training loss",
               lambda r: (list(range(1, len(r["losses"]) + 1)), r["losses"])),
              ("forgetting", "forgetting rate (share of training queries whose MRR@100 dropped)",
               lambda r: ([x["step"] for x in r["refreshes"]
                           if "forgetting_rate" in x["diagnostics"]],
                          [x["diagnostics"]["forgetting_rate"] for x in r["refreshes"]
                           if "forgetting_rate" in x["diagnostics"]]))]
    by_method: dict[str, list[dict]] = {}
    for run in report["runs"]:
        by_method.setdefault(run["method"], []).append(run)
    for slug, title, series in panels:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for method, runs in by_method.items():
            xs, mean, std = mean_over_seeds([series(run) for run in runs])
            line, = ax.plot(xs, mean, marker="o" if slug != "loss" else None,
                            label=f"{method} ({len(runs)} seed{'s' if len(runs) > 1 else ''})")
            if len(runs) > 1:  # ± one standard deviation over seeds
                ax.fill_between(xs, mean - std, mean + std, color=line.get_color(), alpha=0.15)
        if slug == "test-ndcg":
            for name, ref in report["references"].items():
                ax.axhline(ref["test"]["ndcg@10"], linestyle="--", color="grey", linewidth=1)
                ax.annotate(name, (0, ref["test"]["ndcg@10"]), fontsize=8)
        ax.set_title(f"{title} — {report['profile']} profile")
        ax.set_xlabel("training step")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        name = f"{report['name']}-{slug}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names


# What a labelled variant may change besides ``negatives.*``: the optimiser's recipe, not the
# budget (steps, batch, refresh interval, lengths, threads) that makes parts comparable.
RECIPE_FIELDS = ("learning_rate", "warmup_steps", "weight_decay")


def _budget_without(budget: dict, fields: tuple[str, ...]) -> dict:
    """``budget`` without these ``training`` fields."""
    return {**budget, "training": {k: v for k, v in budget["training"].items()
                                   if k not in fields}}


def _comparable(report: dict, key: str) -> object:
    """``report[key]``, without the seed (older reports kept the first seed in the budget)
    and the recipe fields a labelled variant may change."""
    value = report.get(key, "scifact" if key == "dataset" else None)  # older: SciFact only
    if key == "budget":
        value = _budget_without(value, ("seed", *RECIPE_FIELDS))
    return value


def _shared_overrides(overrides: list[str]) -> list[str]:
    """The overrides that may change what every method shares: all but ``negatives.*`` and
    the recipe's ``training.<RECIPE_FIELDS>``."""
    variant = ("negatives.", *(f"training.{field}=" for field in RECIPE_FIELDS))
    return [o for o in overrides if not o.startswith(variant)]


def _check_variants(paths: list[Path], reports: list[dict]) -> None:
    """Parts may differ in ``negatives.*`` and recipe (:data:`RECIPE_FIELDS`) overrides only,
    and then only under distinct method names (``--label``): every run of one method name was
    made with the same overrides."""
    overrides_of: dict[str, tuple[list[str], Path]] = {}
    for path, report in zip(paths, reports, strict=True):
        if _shared_overrides(report["overrides"]) != _shared_overrides(reports[0]["overrides"]):
            raise SystemExit(f"{path}: overrides {report['overrides']} differ from "
                             f"{paths[0]}'s {reports[0]['overrides']} outside negatives.* and "
                             f"training.{{{','.join(RECIPE_FIELDS)}}}; not comparable")
        for run in report["runs"]:
            overrides = run.get("overrides", report["overrides"])
            seen = overrides_of.setdefault(run["method"], (overrides, path))
            if seen[0] != overrides:
                raise SystemExit(f"{path}: {run['method']} was run with {overrides}, in "
                                 f"{seen[1]} with {seen[0]}; name the variant with --label")


def combine(paths: list[Path], name: str) -> dict:
    """One report from several invocations of the same profile and budget.

    Parts may hold different methods (the cpu profile runs four per invocation), more seeds
    of methods already run, or labelled variants of a method (``--label``, different
    ``negatives.*`` or recipe overrides); a (method, seed) pair may appear only once.
    """
    reports = [json.loads(path.read_text()) for path in paths]
    first = reports[0]
    for path, other in zip(paths[1:], reports[1:], strict=True):
        for key in ("profile", "budget", "dataset"):
            if _comparable(other, key) != _comparable(first, key):
                raise SystemExit(f"{path}: {key} differs from {paths[0]}; not comparable")
    _check_variants(paths, reports)
    seen: dict[tuple[str, int], Path] = {}
    for path, report in zip(paths, reports, strict=True):
        for run in report["runs"]:
            pair = (run["method"], run["seed"])
            if pair in seen:
                raise SystemExit(f"{path}: {run['method']} seed {run['seed']} is also in "
                                 f"{seen[pair]}; each method and seed may be merged once")
            seen[pair] = path
    order = list(dict.fromkeys(run["method"] for report in reports for run in report["runs"]))
    runs = sorted((run for report in reports for run in report["runs"]),
                  key=lambda run: (order.index(run["method"]), run["seed"]))
    # The first part's recipe; a variant's own is under "variants".
    return {**first, "name": name, "budget": _budget_without(first["budget"], ("seed",)),
            "command": " && ".join(r["command"] for r in reports),
            "merged_by": command_line(),
            "parts": [{"file": str(p), "date": r["date"], "minutes": r["minutes"],
                       "methods": r["methods"], "seeds": r["seeds"]}
                      for p, r in zip(paths, reports, strict=True)],
            "seeds": sorted({run["seed"] for run in runs}), "methods": order, "runs": runs,
            # What every part was run with (a variant's own: "variants").
            "overrides": [o for o in first["overrides"]
                          if all(o in r["overrides"] for r in reports)],
            "variants": labelled_variants(runs),
            "aggregate": aggregate(runs), "minutes": sum(r["minutes"] for r in reports)}


def budget(config: dict) -> dict:
    """What every method and seed shares: the training, model and inference settings."""
    return {"training": {k: v for k, v in config["training"].items() if k != "seed"},
            "model": config["model"], "inference": config["inference"]}


def save(report: dict, out: Path) -> None:
    """Plots, then the JSON and markdown of a report."""
    report["plots"] = plot(report, out)
    write_report(out, report["name"], report, render_markdown(report))


def default_name(args: argparse.Namespace) -> str:
    """``quality-<profile>-<dataset>`` for a named dataset other than SciFact (``--data
    nfcorpus``), else ``quality-<profile>`` (the names the reports always had)."""
    named = args.dataset in DATASETS and args.dataset != "scifact"
    return f"quality-{args.profile}" + (f"-{args.dataset}" if named else "")


def _stop(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)  # unwinds through run_child, which stops the run
    if args.combine:
        args.out.mkdir(parents=True, exist_ok=True)
        if args.name is None:  # the parts' dataset, not --data's default
            args.dataset = json.loads(args.combine[0].read_text()).get("dataset", "scifact")
        save(combine(args.combine, args.name or default_name(args)), args.out)
        return 0
    seeds = args.seeds or PROFILES[args.profile]["seeds"]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.train_queries is not None:  # outlives the runs' temp dir: BM25 reads it after
        into = (args.runs_dir or Path(tempfile.gettempdir()) / "ance-quality") / "datasets"
        args.data = cut_training_set(args.data, args.train_queries, args.cut_seed,
                                     into.resolve())
        print(f"[quality] training set cut to {args.train_queries} queries: {args.data}",
              flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ance-quality-") as scratch:
        runs_dir = (args.runs_dir or Path(scratch)).resolve()
        runs_dir.mkdir(parents=True, exist_ok=True)
        runs = []
        for method in args.methods:
            for seed in seeds:
                print(f"[quality] {method} seed {seed} ...", flush=True)
                run = run_method(method, seed, args, runs_dir)
                runs.append(run)
                print(f"[quality] {method} seed {seed}: checkpoint {run['selected_step']} "
                      f"dev nDCG@10 {run['dev']['ndcg@10']:.4f} "
                      f"test nDCG@10 {run['test']['ndcg@10']:.4f} ({run['minutes']:.1f} min)",
                      flush=True)
    zero_shot = next(r["metrics"] for r in runs[0]["refreshes"] if r["step"] == 0)
    report = {
        "command": command_line(), "date": utc_now(), "machine": machine(),
        "profile": args.profile, "dataset": args.dataset,
        "name": args.name or default_name(args),
        "overrides": args.overrides, "seeds": seeds,
        **({"train_queries": args.train_queries, "cut_seed": args.cut_seed}
           if args.train_queries is not None else {}),
        "methods": [args.label] if args.label else args.methods,
        "variants": labelled_variants(runs),
        "budget": budget(method_config(args.methods[0], seeds[0], args, Path("runs"))),
        "references": {
            "BM25 (bm25s k1=0.9 b=0.4)": bm25_reference(args),
            "zero-shot (no training)": {"dev": zero_shot["dev"], "test": zero_shot["test"]},
        },
        "aggregate": aggregate(runs), "runs": runs,
        "minutes": (time.monotonic() - started) / 60,
    }
    save(report, args.out)
    return 0
