"""The billion-document shape on the largest corpus this machine holds: a synthetic corpus
through the real services with index partitions, an IVF-PQ index, float16 shards and the store
lifecycle, against what ``ance-train plan`` predicts for the same run.

The encoder is a small randomly initialised BERT (2 layers, hidden 32: the tests' tiny model):
encoding millions of texts with MiniLM on 2 cores would take days, and what this measures is the
data path — shards, partitions, merge, mining, store — not the encoder. Documents are 24
random vocabulary words; every query is a few words of its one positive document.

Measured, per refresh (from the events and ``eval/<k>.json``, as bench/refresh_scaling.py):
period (checkpoint published → negatives ready) split into encode phase / the tail after the
last shard; the indexer stages (build, mine, evaluate, merge); per-process peak RSS (sampled
every 0.5 s; ``VmHWM`` would include start-up); store bytes of every per-refresh object ever
written (what the store holds without the lifecycle) against what it holds at the end with
``store.keep_refreshes``.

    python bench/scale.py --docs 2000000 --partitions 2
    python bench/scale.py --docs 200000 --partitions 2 --name scale-200k   # a quick look

Writes ``<name>.json`` and ``<name>.md`` (default ``scale``) into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from ance_train.config import load_config
from ance_train.index import capacity
from ance_train.infra import bus as events
from ance_train.launcher.embedded import EmbeddedRun
from ance_train.protocol import keys

from ance_train_dev.helpers import write_config
from ance_train_dev.refresh_scaling import refreshes
from ance_train_dev.report import command_line, machine, utc_now, write_report
from ance_train_dev.synthetic import make_tiny_bert, write_beir

REPO = Path(__file__).resolve().parents[1]

WORDS_PER_DOC = 24
HIDDEN = 32  # the tiny encoder's embedding dimension


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=2_000_000)
    p.add_argument("--train-queries", type=int, default=20_000)
    p.add_argument("--test-queries", type=int, default=500)
    p.add_argument("--partitions", type=int, default=2)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--shards", type=int, default=40, help="corpus shards per refresh")
    p.add_argument("--steps", type=int, default=2, help="refreshes after checkpoint 0")
    p.add_argument("--keep-refreshes", type=int, default=1)
    p.add_argument("--build-while-encoding", action=argparse.BooleanOptionalAction,
                   default=True, help="index.build_while_encoding (plan --overlap-build)")
    p.add_argument("--max-minutes", type=float, default=120.0)
    p.add_argument("--baseline-docs", type=int, default=20_000,
                   help="a first run over this many documents: the processes' memory "
                        "without the data's")
    p.add_argument("--name", default="scale")
    p.add_argument("--out", type=Path, default=REPO / "docs/benchmarks")
    return p.parse_args(argv)


class Sampler:
    """Peak RSS of every service process (and its children: torchrun ranks) and the size of
    every store object ever seen, sampled in a background thread."""

    def __init__(self, run: EmbeddedRun, store_dir: Path, every_s: float = 0.5) -> None:
        self.run, self.store_dir, self.every_s = run, store_dir, every_s
        self.peak_rss: dict[str, int] = {}
        self.objects: dict[str, int] = {}  # key → largest size seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._list_store()  # what the last seconds wrote

    def _list_store(self) -> None:
        for path in self.store_dir.rglob("*"):
            try:
                if path.is_file() and not path.name.endswith((".tmp", ".sha256")):
                    key = path.relative_to(self.store_dir).as_posix()
                    self.objects[key] = max(self.objects.get(key, 0), path.stat().st_size)
            except OSError:
                continue

    def _loop(self) -> None:
        last_store = 0.0
        while not self._stop.wait(self.every_s):
            for child in list(self.run.children):
                try:
                    proc = psutil.Process(child.process.pid)
                    rss = proc.memory_info().rss + sum(
                        c.memory_info().rss for c in proc.children(recursive=True))
                except psutil.Error:
                    continue
                self.peak_rss[child.name] = max(self.peak_rss.get(child.name, 0), rss)
            if time.monotonic() - last_store > 5.0:  # a listing costs more than a sample
                last_store = time.monotonic()
                self._list_store()


def run_config(args: argparse.Namespace, data: Path, model: Path, root: Path, docs: int,
               name: str) -> dict:
    return {
        "run_id": name, "output_dir": str(root),
        "data": {"path": str(data), "dev_fraction": 0.02, "dev_max_queries": 200},
        "model": {"path": str(model), "max_query_length": 16, "max_doc_length": 40},
        "training": {"steps": args.steps, "batch_size": 16, "warmup_steps": 0,
                     "refresh_every": 1, "torch_threads": 1},
        "negatives": {"pool": "ann", "warmup": "none", "per_query": 1, "top_k": 100},
        "inference": {"replicas": args.replicas, "shard_size": -(-docs // args.shards),
                      "query_shard_size": 20_000, "batch_size": 256, "torch_threads": 1,
                      "claim_timeout_s": 1800, "embedding_dtype": "float16"},
        "index": {"type": "ivfpq", "pq": {"m": 8}, "partitions": args.partitions,
                  "eval_depth": 100, "build_while_encoding": args.build_while_encoding},
        "store": {"keep_refreshes": args.keep_refreshes},
    }


def per_refresh_bytes(objects: dict[str, int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for key, size in objects.items():
        step = keys.refresh_step(key)  # keys relative to the run's prefix
        if step is not None:
            out[step] = out.get(step, 0) + size
    return out


def measure(args: argparse.Namespace, root: Path, docs: int, train_queries: int,
            name: str) -> dict:
    """One embedded run over a fresh synthetic corpus of ``docs`` documents."""
    started = time.monotonic()
    data = write_beir(root / f"data-{name}", docs, train_queries, args.test_queries,
                      words_per_doc=WORDS_PER_DOC)
    model = make_tiny_bert(root / "model", hidden=HIDDEN)
    print(f"[scale] {name}: data + model in {time.monotonic() - started:.0f}s", file=sys.stderr)
    config_path = write_config(root / f"{name}.yaml",
                               **run_config(args, data, model, root, docs, name))
    config = load_config(config_path)
    load_before = os.getloadavg()
    run = EmbeddedRun(config, config_path, overwrite=True, max_minutes=args.max_minutes)
    started = time.monotonic()
    run.prepare()
    prepare_s = time.monotonic() - started
    store_dir = run.store_dir / config.run_id
    try:
        with Sampler(run, store_dir) as sampler:
            run.start_services()
            run.monitor()
        assert run.redis is not None
        bus = events.EventBus(events.connect(run.redis.url), config.run_id)
        measured = refreshes(bus, run.store)
        reports = {r["step"]: run.store.get_json(keys.eval_report(r["step"]))
                   for r in measured}
    finally:
        run.stop()
    written = per_refresh_bytes(sampler.objects)
    for row in measured:
        row["timings"] = reports[row["step"]]["timings"]
        row["tail_s"] = row["period_s"] - row["encode_phase_s"]
        row["store_bytes_written"] = written.get(row["step"], 0)
    return {"config": config, "dataset": run.dataset, "prepare_s": prepare_s,
            "refreshes": measured, "peak_rss_bytes": sampler.peak_rss,
            "load_average": [load_before, os.getloadavg()],
            "store": {"bytes_at_end": sum(p.stat().st_size for p in store_dir.rglob("*")
                                          if p.is_file()),
                      "bytes_without_lifecycle": sum(sampler.objects.values()),
                      "per_refresh_written": written}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-scale-", dir=REPO.parent) as tmp:
        root = Path(tmp)
        # The same services over a small corpus: their memory without the data's.
        baseline = measure(args, root, args.baseline_docs, args.baseline_docs // 25,
                           f"{args.name}-baseline")
        main_run = measure(args, root, args.docs, args.train_queries, args.name)
    config, dataset, measured = main_run["config"], main_run["dataset"], main_run["refreshes"]
    rates = [rep["docs_per_s"] for r in measured for rep in r["per_replica"].values()
             if rep["docs_per_s"]]
    train, evaluated = len(dataset.train), len(dataset.dev) + len(dataset.test)
    load = capacity.workload(docs=dataset.num_docs, dim=HIDDEN, replicas=args.replicas,
                             docs_per_s=statistics.median(rates), train_queries=train,
                             eval_queries=evaluated, doc_tokens=WORDS_PER_DOC + 2,
                             config=config, embedding_bytes=2,
                             overlap_build=args.build_while_encoding)
    predicted = capacity.plan(load)
    report = {
        "command": command_line(), "date": utc_now(),
        "machine": {**machine("cpu"), "load_average_start": main_run["load_average"][0],
                    "load_average_end": main_run["load_average"][1]},
        "params": {**vars(args), "out": str(args.out), "docs_in_corpus": dataset.num_docs,
                   "train_queries": train, "eval_queries": evaluated,
                   "encoder": f"random BERT, 2 layers, hidden {HIDDEN}"},
        "prepare_s": main_run["prepare_s"], "refreshes": measured,
        "peak_rss_bytes": main_run["peak_rss_bytes"],
        "baseline_peak_rss_bytes": baseline["peak_rss_bytes"],
        "baseline_docs": baseline["dataset"].num_docs,
        "store": main_run["store"],
        "plan": {"workload": capacity.describe(load), **predicted.to_dict()},
    }
    write_report(args.out, args.name, report, render(report))
    return 0


def _mine_per_100k(report: dict) -> float:
    mine = statistics.median(r["timings"].get("mine_s", 0.0) for r in report["refreshes"])
    return mine * 100_000 / max(report["params"]["train_queries"], 1)


def _gb(value: float) -> str:
    return f"{value / 1e9:.2f} GB"


def render(report: dict) -> str:
    p, m = report["params"], report["machine"]
    lines = [f"# Scale: {p['docs_in_corpus']:,} documents, {p['partitions']} index partitions",
             "", f"Command: `{report['command']}`", "",
             f"Machine: {m['cpu']} ({', '.join(m['cpu_flags'])}) — {m['cores']} cores; "
             f"{report['date']}. Load average (1 min) before {m['load_average_start'][0]:.1f}, "
             f"after {m['load_average_end'][0]:.1f}.", "",
             f"{p['docs_in_corpus']:,} synthetic documents ({WORDS_PER_DOC} words), "
             f"{p['train_queries']:,} training and {p['eval_queries']:,} evaluation queries; "
             f"encoder: {p['encoder']} (a stand-in: the data path is what is measured); "
             f"{p['replicas']} inferencers, {p['shards']} corpus shards, float16 shards, "
             f"IVF-PQ (m 8) in {p['partitions']} partitions, store.keep_refreshes "
             f"{p['keep_refreshes']}, index.build_while_encoding "
             f"{str(p.get('build_while_encoding', False)).lower()}. Validation and the offset "
             "index: "
             f"{report['prepare_s']:.0f} s.", "",
             "## Refreshes", "",
             "*Build after the last shard*: the slowest partition's build once its last shard "
             "was in (with index.build_while_encoding the shards before it went in while "
             "encoding: *shards added early*).", "",
             "| checkpoint | period | encode phase | tail after last shard | shards added "
             "early | build after the last shard | search | merge | mine | evaluate | "
             "docs/s per replica | store bytes written |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["refreshes"]:
        t = r["timings"]
        rates = [v["docs_per_s"] for v in r["per_replica"].values() if v["docs_per_s"]]
        lines.append(f"| {r['step']} | {r['period_s']:.0f} s | {r['encode_phase_s']:.0f} s | "
                     f"{r['tail_s']:.0f} s | {t.get('shards_added_early', 0):.0f} of "
                     f"{p['shards']} | {t.get('build_s', 0):.0f} s | "
                     f"{t.get('search_s', 0):.1f} s | {t.get('merge_s', 0):.1f} s | "
                     f"{t.get('mine_s', 0):.1f} s | {t.get('eval_s', 0):.1f} s | "
                     f"{statistics.median(rates) if rates else 0:,.0f} | "
                     f"{_gb(r['store_bytes_written'])} |")
    base = report.get("baseline_peak_rss_bytes", {})
    lines += ["", "## Peak RSS per process", "",
              f"*Baseline*: the same services over {report.get('baseline_docs', 0):,} "
              "documents (their runtime: Python, torch, FAISS, the model); *growth*: what "
              f"{p['docs_in_corpus']:,} documents added.", "",
              "| process | baseline | peak RSS | growth |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {_gb(base.get(name, 0))} | {_gb(rss)} | "
              f"{_gb(rss - base.get(name, 0))} |"
              for name, rss in sorted(report["peak_rss_bytes"].items())]
    s = report["store"]
    lines += ["", "## Store", "",
              f"Every object ever written: {_gb(s['bytes_without_lifecycle'])} (what the store "
              f"would hold without the lifecycle); at the end, with store.keep_refreshes "
              f"{p['keep_refreshes']}: {_gb(s['bytes_at_end'])}.", ""]
    plan = report["plan"]
    measured_period = statistics.median(r["period_s"] for r in report["refreshes"])
    per_refresh = statistics.median(r["store_bytes_written"] for r in report["refreshes"])
    predicted_refresh_bytes = (plan["storage_bytes"]["total"]
                               - plan["storage_bytes"]["checkpoint"])
    lines += ["## `ance-train plan` for this run", "",
              "| quantity | predicted | measured | predicted / measured |", "|---|---:|---:|---:|",
              f"| refresh period | {plan['refresh_s']:.0f} s | {measured_period:.0f} s | "
              f"{plan['refresh_s'] / measured_period:.2f} |",
              f"| store bytes per refresh (embeddings, partial lists, negatives) | "
              f"{_gb(predicted_refresh_bytes)} | {_gb(per_refresh)} | "
              f"{predicted_refresh_bytes / max(per_refresh, 1):.2f} |"]
    growth = {name: rss - base.get(name, 0) for name, rss in report["peak_rss_bytes"].items()}
    zero = growth.get("indexer-0")
    others = [v for k, v in growth.items() if k.startswith("indexer-") and k != "indexer-0"]
    if zero is not None and base:
        lines.append(f"| indexer partition 0, working set beyond the runtime | "
                     f"{_gb(plan['indexer_bytes'])} | {_gb(zero)} (growth) | "
                     f"{plan['indexer_bytes'] / max(zero, 1):.2f} |")
    if others and base:
        lines.append(f"| other partitions, working set | {_gb(plan['partition_bytes'])} | "
                     f"{_gb(max(others))} (growth) | "
                     f"{plan['partition_bytes'] / max(max(others), 1):.2f} |")
    lines += ["", "The plan is given this run's measured docs/s per replica (median) and its "
                  "built-in index rates (bench/indexer.py on this kind of machine); its "
                  "refresh period is compared with the median measured one. Mining: "
                  f"{_mine_per_100k(report):.1f} s per 100,000 training queries here "
                  "(ANCE top-100 on the merged lists; docs/benchmarks/mining.md times each "
                  "stage before and after vectorising)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
