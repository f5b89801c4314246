"""Refresh period with 1, 2, 4 inferencer replicas, through the real services.

Each run is the embedded mode (``EmbeddedRun``: redis-server, trainer, ``n`` inferencers
with one torch thread each, indexer, as OS processes) on a SciFact slice: the first
``--docs`` documents and the queries whose positives all lie among them (so the qrels stay
consistent). The trainer publishes checkpoint 0 and waits for its negatives (ANN pool, no
BM25 warm-up), trains ``--steps`` step(s) and publishes its final checkpoint, so every run
holds two refreshes during which the trainer is not computing.

Per refresh, from the events (Redis entry ids are the server's clock) and ``eval/<k>.json``:

- period = ``negatives.ready`` − ``checkpoint.published``;
- encode phase = last ``shard.encoded`` − ``checkpoint.published``, split into the replicas'
  time loading the checkpoint, encoding, uploading and idle (waiting for work at the tail)
  in proportion to their busy time;
- index (``build_s``: fetch the shards + add them), mine (``mine_s``), evaluate (``eval_s``,
  before ``negatives.ready`` in the indexer) and other (event latency, polling);
- docs/s per replica (corpus shards only).

Scaling efficiency(n) = T₁ / (n · Tₙ) on the median period. Replica counts alternate round by
round (``--rounds``) so they share the machine's noise.

    python bench/refresh_scaling.py --docs 320 --replicas 1 2 4

Writes ``refresh_scaling.json`` / ``refresh_scaling.md`` / ``refresh_scaling.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from ance_train.config import load_config
from ance_train.infra import bus as events
from ance_train.launcher.embedded import EmbeddedRun
from ance_train.modeling.model import load_tokenizer
from ance_train.protocol import keys
from ance_train.protocol.events import CheckpointPublished, NegativesReady, ShardEncoded

from ance_train_dev.helpers import make_scifact_subset, write_config
from ance_train_dev.report import (
    DEFAULT_MODEL,
    command_line,
    machine,
    model_directory,
    utc_now,
    write_report,
)

REPO = Path(__file__).resolve().parents[2]

PARTS = ("load", "encode", "upload", "idle", "index", "mine", "eval", "other")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, type=model_directory)
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared/data/scifact")
    parser.add_argument("--docs", type=int, default=320, help="first N SciFact documents")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--shards", type=int, default=16, help="corpus shards per refresh")
    parser.add_argument("--doc-length", type=int, default=256)
    parser.add_argument("--query-length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "int8"])
    parser.add_argument("--max-minutes", type=float, default=15.0, help="per run")
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks")
    return parser.parse_args(argv)


def run_config(args: argparse.Namespace, data: Path, root: Path, replicas: int) -> dict:
    return {
        "run_id": f"scaling-{replicas}", "output_dir": str(root),
        "data": {"path": str(data)},
        "model": {"path": args.model, "similarity": "cosine", "temperature": 0.05,
                  "max_query_length": args.query_length, "max_doc_length": args.doc_length},
        "training": {"steps": args.steps, "batch_size": 8, "warmup_steps": 0,
                     "refresh_every": max(args.steps, 1), "torch_threads": 1},
        "negatives": {"pool": "ann", "warmup": "none", "per_query": 1},
        "inference": {"replicas": replicas, "shard_size": -(-args.docs // args.shards),
                      "query_shard_size": 64, "batch_size": 32, "torch_threads": 1,
                      "claim_timeout_s": 300, "precision": args.precision},
    }


def mean_doc_tokens(model: str, data: Path, max_length: int) -> float:
    """Mean tokens per document of the slice after truncation (what docs/s is measured at)."""
    texts = [f"{d.get('title', '')} {d.get('text', '')}" for d in
             map(json.loads, (data / "corpus.jsonl").read_text().splitlines())]
    ids = load_tokenizer(model)(texts, truncation=True, max_length=max_length)["input_ids"]
    return sum(map(len, ids)) / len(ids)


def refreshes(bus: events.EventBus, store) -> list[dict]:
    """Period and its parts for every checkpoint that got its negatives."""
    published = {e.step: events.entry_seconds(e.entry_id)
                 for e in bus.history(CheckpointPublished)}
    ready = {e.step: events.entry_seconds(e.entry_id)
             for e in bus.history(NegativesReady) if e.step is not None}
    shards: dict[int, list[events.Received[ShardEncoded]]] = {}
    for received in bus.history(ShardEncoded):
        shards.setdefault(received.step, []).append(received)
    out = []
    for step in sorted(set(published) & set(ready)):
        period = ready[step] - published[step]
        done = shards[step]
        encode_wall = max(events.entry_seconds(e.entry_id) for e in done) - published[step]
        instances = sorted({e.event.instance for e in done})
        busy = {part: sum(getattr(e.event, f"{part}_s") for e in done)
                for part in ("load", "encode", "upload")}
        capacity = len(instances) * encode_wall
        busy["idle"] = max(capacity - sum(busy.values()), 0.0)
        scale = encode_wall / max(sum(busy.values()), 1e-9)
        timings = store.get_json(keys.eval_report(step))["timings"]
        parts = {part: seconds * scale for part, seconds in busy.items()}
        parts.update(index=timings["build_s"], mine=timings["mine_s"], eval=timings["eval_s"])
        parts["other"] = period - sum(parts.values())
        per_replica = {}
        for instance in instances:
            corpus = [e.event for e in done
                      if e.event.instance == instance and e.event.kind == "corpus"]
            docs = sum(p.count for p in corpus)
            seconds = sum(p.encode_s for p in corpus)
            per_replica[instance] = {"corpus_docs": docs, "encode_s": seconds,
                                     "docs_per_s": docs / seconds if seconds else None}
        out.append({"step": step, "period_s": period, "encode_phase_s": encode_wall,
                    "parts_s": parts, "replicas_used": len(instances),
                    "per_replica": per_replica, "shards": len(done)})
    return out


def one_run(args: argparse.Namespace, data: Path, root: Path, replicas: int) -> dict:
    config_path = write_config(root / f"scaling-{replicas}.yaml",
                               **run_config(args, data, root, replicas))
    config = load_config(config_path)
    load_before = os.getloadavg()
    run = EmbeddedRun(config, config_path, overwrite=True, max_minutes=args.max_minutes)
    run.prepare()
    try:
        run.start_services()
        run.monitor()
        assert run.redis is not None
        bus = events.EventBus(events.connect(run.redis.url), config.run_id)
        measured = refreshes(bus, run.store)
    finally:
        run.stop()
    return {"replicas": replicas, "refreshes": measured, "corpus_docs": run.dataset.num_docs,
            "queries_encoded": sum(len(s) for s in (run.dataset.train, run.dataset.dev,
                                                      run.dataset.test)),
            "shard_size": config.inference.shard_size,
            "load_average_before": load_before, "load_average_after": os.getloadavg()}


def summarise(runs: list[dict], replica_counts: list[int]) -> dict:
    by_n: dict[int, dict] = {}
    for n in replica_counts:
        rows = [r for run in runs if run["replicas"] == n for r in run["refreshes"]]
        periods = [r["period_s"] for r in rows]
        rates = [rep["docs_per_s"] for r in rows for rep in r["per_replica"].values()
                 if rep["docs_per_s"]]
        by_n[n] = {"period_s": statistics.median(periods), "periods_s": periods,
                   "parts_s": {p: statistics.median(r["parts_s"][p] for r in rows)
                               for p in PARTS},
                   "docs_per_s_per_replica": statistics.median(rates) if rates else None,
                   "refreshes": len(rows)}
    base = by_n[min(replica_counts)]
    for n, row in by_n.items():
        row["efficiency_vs_min"] = (base["period_s"] * min(replica_counts)) / (n * row["period_s"])
        row["speedup_vs_min"] = base["period_s"] / row["period_s"]
    return by_n


def render(report: dict) -> str:
    p, m = report["params"], report["machine"]
    runs = report["runs"]
    lines = [
        "# Refresh scaling with inferencer replicas (SciFact slice, CPU)", "",
        f"Command: `{report['command']}`", "",
        f"Machine: {m['cpu']} — {m['cores']} cores, torch {m['torch']}; {report['date']}. "
        "Load average (1 min) before/after each run: " + ", ".join(
            f"{r['replicas']} repl. {r['load_average_before'][0]:.1f}/"
            f"{r['load_average_after'][0]:.1f}" for r in runs), "",
        f"Params: {runs[0]['corpus_docs']} docs at {p['doc_length']} tokens "
        f"({runs[0]['queries_encoded']} queries at {p['query_length']}), shards of "
        f"{runs[0]['shard_size']} docs, one torch thread per replica, precision "
        f"{p['precision']}, {p['rounds']} round(s), 2 refreshes per run (checkpoints 0 and "
        f"{p['steps']}), model `{p['model']}`", "",
        "| replicas | period (median) | speedup | efficiency T₁/(n·Tₙ) | docs/s per replica "
        "| " + " | ".join(PARTS) + " |",
        "|---:|---:|---:|---:|---:|" + "---:|" * len(PARTS),
    ]
    for n, row in report["summary"].items():
        shares = row["parts_s"]
        parts = " | ".join(f"{shares[part]:.1f} s ({shares[part] / row['period_s']:.0%})"
                           for part in PARTS)
        rate = row["docs_per_s_per_replica"]
        lines.append(f"| {n} | {row['period_s']:.1f} s | {row['speedup_vs_min']:.2f}× | "
                     f"{row['efficiency_vs_min']:.0%} | {rate:.2f} | {parts} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["summary"]
    counts = [str(n) for n in summary]
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(counts)
    for part in PARTS:
        values = [summary[n]["parts_s"][part] for n in summary]
        ax.bar(counts, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, n in enumerate(summary):
        ax.annotate(f"eff. {summary[n]['efficiency_vs_min']:.0%}", (i, bottom[i]),
                    ha="center", va="bottom")
    ax.set_xlabel("inferencer replicas (1 torch thread each)")
    ax.set_ylabel("refresh period, s (median)")
    ax.set_title(f"Refresh period split ({report['machine']['cores']}-core CPU)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    name = "refresh_scaling.png"
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = make_scifact_subset(root / "scifact-slice", max_docs=args.docs,
                                   max_queries=10_000)
        doc_tokens = mean_doc_tokens(args.model, data, args.doc_length)
        for round_index in range(args.rounds):
            order = args.replicas if round_index % 2 == 0 else args.replicas[::-1]
            for n in order:
                run = one_run(args, data, root, n)
                runs.append(run)
                print(f"{n} replica(s): " + ", ".join(
                    f"refresh {r['step']} {r['period_s']:.1f}s" for r in run["refreshes"]),
                    file=sys.stderr)
    report = {
        "command": command_line(), "date": utc_now(), "machine": machine("cpu"),
        "params": {"model": args.model, "docs": args.docs, "doc_length": args.doc_length,
                   "query_length": args.query_length, "shards": args.shards,
                   "steps": args.steps, "rounds": args.rounds, "precision": args.precision,
                   "replicas": args.replicas},
        "summary": summarise(runs, args.replicas),
        "runs": runs,
    }
    # What `ance-train plan` reads: one replica's corpus docs/s and the tokens per document.
    report["per_replica_docs_per_s"] = report["summary"][min(args.replicas)][
        "docs_per_s_per_replica"]
    report["doc_tokens"] = doc_tokens
    args.out.mkdir(parents=True, exist_ok=True)
    image = plot(report, args.out)
    write_report(args.out, "refresh_scaling", report,
                 render(report) + f"\n![refresh period]({image})\n")
    return 0
