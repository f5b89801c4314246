"""What the asynchronous negatives cost the trainer, measured on the real Trainer service code.

The trainer (``ance_train.trainer.trainer.Trainer``) runs in this process against a real
Redis server and the local object store, on SciFact with all-MiniLM-L6-v2. This script
plays the indexer: it publishes an ANN-shaped negatives table (``--top-k`` candidates per
training query, uniform probabilities) before the first step and a new one every
``--swap-every-s`` seconds while the trainer runs, so the trainer swaps tables mid-run.

(a) time per batch spent obtaining negatives: the trainer's own ``negatives_ms`` (choosing
    the source + drawing the negatives + assembling the batch), and a micro-benchmark of the
    same calls repeated ``--micro`` times on the same table;
(b) time blocked on refreshes: waits for negatives after the first table (calls to
    ``feed.wait_until`` after step 1; the design has none), the step time of steps that
    swapped tables vs the others, and the in-loop checkpoint snapshot (the trainer's own
    share of a refresh: the upload is in the background);
(c) step throughput vs a plain PyTorch loop over the same model (same initial weights, same
    AdamW + linear schedule, same clipping), on the very batches the trainer built, already
    tokenised. The two alternate step by step: after each trainer step (once its time is
    taken) the plain loop takes its step on the same batch, so both see the same machine
    noise; the trainer's background threads (checkpoint upload, negatives feed) run during
    both. The first step of each run is a warm-up and is not counted.

(d) the one-batch lookahead (``trainer/prefetch.py``): the trainer alone (no plain loop
    beside it), ``--overlap-runs`` runs with batch s+1 read and tokenised on the background
    thread while step s computes, and as many with the same work done on the loop's thread
    (``BatchPreparer(background=False)``: build s+1, read + tokenise it, then step s — the
    sequential cost), alternating. Reported: median step time, the preparation's own time
    (``prepare_ms``) and how long a step still waited for it (``prepare_wait_ms``).

    python bench/trainer_overhead.py --repeats 3 --steps 12 --threads 1
    python bench/trainer_overhead.py --overlap-only --tiny --steps 30 --overlap-runs 3

Writes ``trainer_overhead.json`` / ``trainer_overhead.md`` into ``--out``
(``--overlap-only``: ``trainer_prefetch.json`` / ``.md``, (d) alone).
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

import numpy as np
import torch
import yaml
from transformers import get_linear_schedule_with_warmup

from ance_train.config import ModelConfig, default_model_path, load_config
from ance_train.infra import bus as events
from ance_train.infra.store import LocalStore
from ance_train.launcher.redis_server import RedisServer
from ance_train.modeling.model import BiEncoder, load_tokenizer
from ance_train.negatives.table import PAD, SOURCE_CODE, NegativesTable, uniform_probabilities
from ance_train.protocol.events import NegativesReady
from ance_train.protocol.tables import TableId
from ance_train.runtime import ServiceOptions, connect_context, prepare_dataset
from ance_train.trainer.loss import contrastive_nll
from ance_train.trainer.prefetch import BatchPreparer
from ance_train.trainer.trainer import Trainer

from ance_train_dev.report import (
    DEFAULT_MODEL,
    command_line,
    machine,
    model_directory,
    utc_now,
    write_report,
)

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, type=model_directory)
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared/data/scifact")
    parser.add_argument("--steps", type=int, default=12, help="steps per trainer run")
    parser.add_argument("--refresh-every", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="trainer runs (and plain runs)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--query-length", type=int, default=48)
    parser.add_argument("--doc-length", type=int, default=96)
    parser.add_argument("--top-k", type=int, default=200)
    parser.add_argument("--swap-every-s", type=float, default=8.0)
    parser.add_argument("--micro", type=int, default=2000, help="micro-benchmark batches")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--per-query", type=int, default=1, help="ANN negatives per query")
    parser.add_argument("--overlap-runs", type=int, default=1,
                        help="(d): trainer runs with the lookahead and as many without")
    parser.add_argument("--overlap-only", action="store_true", help="only (d)")
    parser.add_argument("--tiny", action="store_true",
                        help="the tests' tiny random BERT (2 layers, hidden 32) for --model")
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks")
    return parser.parse_args(argv)


def run_config(args: argparse.Namespace, run_id: str, output_dir: Path) -> dict:
    return {
        "run_id": run_id, "output_dir": str(output_dir),
        "data": {"path": str(args.data)},
        "model": {"path": args.model, "similarity": "cosine", "temperature": 0.05,
                  "max_query_length": args.query_length, "max_doc_length": args.doc_length},
        "training": {"steps": args.steps, "batch_size": args.batch_size, "warmup_steps": 2,
                     "learning_rate": 2e-5, "refresh_every": args.refresh_every,
                     "torch_threads": args.threads, "seed": 13},
        "negatives": {"pool": "ann", "warmup": "none", "per_query": args.per_query,
                      "top_k": args.top_k},
    }


def synthetic_table(dataset, step: int, top_k: int, seed: int) -> NegativesTable:
    """An ANN-shaped table: ``top_k`` random non-positive documents per training query."""
    rng = np.random.default_rng(seed)
    query_ids = sorted(dataset.train)
    candidates = np.full((len(query_ids), top_k), PAD, dtype=np.int64)
    for row, qid in enumerate(query_ids):
        pool = rng.choice(dataset.num_docs, size=top_k + 20, replace=False)
        pool = pool[~np.isin(pool, list(dataset.train[qid]))][:top_k]
        candidates[row, : len(pool)] = pool
    return NegativesTable(
        step=step, query_ids=np.array(query_ids), candidates=candidates,
        scores=rng.random(candidates.shape, dtype=np.float32),
        positive_scores=np.ones(len(query_ids), np.float32),
        probabilities=uniform_probabilities(candidates),
        sources=np.where(candidates != PAD, SOURCE_CODE["ann"], -1).astype(np.int8))


class FakeIndexer:
    """Publishes a negatives table now and then a newer one every ``period_s`` seconds.

    The tables are serialised up front, so that while the trainer runs this thread only
    writes bytes and an event (what the real indexer, another process, costs the trainer's
    process is nothing; the trainer's own feed thread still loads every table)."""

    def __init__(self, store, bus: events.EventBus, dataset, top_k: int, period_s: float,
                 tables: int):
        self.store, self.bus, self.period_s = store, bus, period_s
        self.tables = [synthetic_table(dataset, step, top_k, seed=step).to_bytes()
                       for step in range(tables)]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.published = 0

    def publish(self, step: int) -> None:
        table = TableId.ann(step)
        self.store.put_bytes(table.key, self.tables[step])
        self.bus.publish(NegativesReady(tables=(table,)))
        self.published += 1

    def _loop(self) -> None:
        step = 0
        while step + 1 < len(self.tables) and not self.stop.wait(self.period_s):
            step += 1
            self.publish(step)

    def __enter__(self) -> FakeIndexer:
        self.publish(0)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


class TimedSource:
    """A negatives source whose batch draws are timed (thread CPU milliseconds)."""

    def __init__(self, source, times: list[float]) -> None:
        self.source, self.times = source, times

    def sample(self, query_id: str, n: int, rng: np.random.Generator) -> list[int]:
        return self.source.sample(query_id, n, rng)

    def sample_many(self, query_ids, n: int, rng: np.random.Generator) -> list[list[int]]:
        started = time.thread_time()
        drawn = self.source.sample_many(query_ids, n, rng)
        self.times.append((time.thread_time() - started) * 1000)
        return drawn


class Instrumented:
    """Wraps a Trainer instance's methods to time what the loop does, without changing it."""

    def __init__(self, trainer: Trainer, after_step=None) -> None:
        self.trainer = trainer
        self.batches: list = []
        self.checkpoint_s: dict[int, float] = {}
        self.negatives_cpu_ms: list[float] = []  # CPU time of the thread: immune to preemption
        self.sampling_cpu_ms: list[float] = []  # of that, drawing from the table alone
        self.waits_after_first = 0
        self._cpu_started = 0.0
        build, log_step, checkpoint = (trainer.batches.build, trainer._log_step,
                                       trainer._checkpoint)
        pick, wait_until = trainer.picker.pick, trainer.feed.wait_until

        def timed_pick(*a, **k):
            self._cpu_started = time.thread_time()
            source, step = pick(*a, **k)
            return (None if source is None else TimedSource(source, self.sampling_cpu_ms)), step

        def recorded_build(*a, **k):
            batch = build(*a, **k)
            self.negatives_cpu_ms.append((time.thread_time() - self._cpu_started) * 1000)
            self.batches.append(batch)
            return batch

        def log_then_plain_step(*a, **k):
            log_step(*a, **k)  # the trainer step's time was taken before this call
            if after_step is not None:  # batch s+1 is already built (lookahead): take s's
                after_step(self.batches[trainer.step - 1])

        def timed_checkpoint(step, *a, **k):
            started = time.perf_counter()
            checkpoint(step, *a, **k)
            self.checkpoint_s[step] = time.perf_counter() - started

        def counted_wait(*a, **k):
            if trainer.step > 0:
                self.waits_after_first += 1
            return wait_until(*a, **k)

        trainer.picker.pick = timed_pick
        trainer.batches.build = recorded_build
        trainer._log_step = log_then_plain_step
        trainer._checkpoint = timed_checkpoint
        trainer.feed.wait_until = counted_wait


def tokenise(batch, tokenizer, corpus, args) -> dict:
    """A trainer batch as tensors, ready for the plain loop (untimed)."""
    q = tokenizer(batch.query_texts, padding=True, truncation=True,
                  max_length=args.query_length, return_tensors="pt")
    d = tokenizer(corpus.texts(batch.doc_indices), padding=True, truncation=True,
                  max_length=args.doc_length, return_tensors="pt")
    return {"q": q, "d": d, "positive": batch.positive_column, "allowed": batch.allowed}


class PlainLoop:
    """The textbook PyTorch loop over the same model, optimizer, schedule and clipping."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(13)
        self.model = BiEncoder.from_pretrained(args.model, ModelConfig(
            path=args.model, similarity="cosine", temperature=0.05)).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=2e-5, weight_decay=0.01)
        self.scheduler = get_linear_schedule_with_warmup(self.optimizer, 2, args.steps)
        self.seconds: list[float] = []

    def step(self, batch: dict) -> None:
        started = time.perf_counter()
        q = self.model(batch["q"]["input_ids"], batch["q"]["attention_mask"])
        d = self.model(batch["d"]["input_ids"], batch["d"]["attention_mask"])
        loss = contrastive_nll(self.model.score(q, d), batch["positive"], batch["allowed"])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 2.0)
        self.optimizer.step()
        self.scheduler.step()
        float(loss.detach())
        self.seconds.append(time.perf_counter() - started)


def trainer_run(args: argparse.Namespace, root: Path, redis_url: str, run_id: str,
                paired: bool = True, background: bool = True) -> dict:
    """One trainer run; ``paired``: the plain loop steps after each trainer step (c);
    ``background``: the lookahead's preparation on its thread (else on the loop's, (d))."""
    config_path = root / f"{run_id}.yaml"
    config_path.write_text(yaml.safe_dump(run_config(args, run_id, root)))
    config = load_config(config_path)
    store = LocalStore(run_id, root / "store")
    dataset = prepare_dataset(config, store, root / run_id / "cache")
    options = ServiceOptions(role="trainer", config_path=str(config_path), redis_url=redis_url,
                             work_dir=str(root / run_id / "work"), instance="trainer",
                             store_dir=str(root / "store"))
    ctx = connect_context(options)
    trainer = Trainer(ctx)
    if not background:
        inline = trainer.preparer
        inline.close()
        trainer.preparer = BatchPreparer(inline.tokenizer, ctx.corpus, args.query_length,
                                         args.doc_length, background=False)
    plain = PlainLoop(args) if paired else None
    tokenizer = load_tokenizer(args.model)
    probe = Instrumented(trainer, after_step=None if plain is None else lambda batch:
                         plain.step(tokenise(batch, tokenizer, ctx.corpus, args)))
    tables = 2 + int(args.steps * 8 / args.swap_every_s)  # enough for steps of up to 8 s
    with FakeIndexer(store, ctx.bus, dataset, args.top_k, args.swap_every_s,
                     tables) as indexer:
        record = trainer.run()
    ctx.stop.set()  # ends the negatives feed's thread
    loop_checkpoints = {s: t for s, t in probe.checkpoint_s.items() if 0 < s < args.steps}
    swap_steps = {swap["step"] for swap in record.swaps}
    step_seconds = record.step_seconds
    return {
        "trainer": trainer, "train_queries": len(ctx.dataset.train),
        "negatives_ms": record.negatives_ms, "negatives_cpu_ms": list(probe.negatives_cpu_ms),
        "sampling_cpu_ms": list(probe.sampling_cpu_ms),
        "step_seconds": step_seconds,
        "plain_step_seconds": [] if plain is None else plain.seconds,
        "prepare_ms": record.prepare_ms, "prepare_wait_ms": record.prepare_wait_ms,
        "wait_before_first_s": record.wait_before_first_s,
        "waits_after_first": probe.waits_after_first,
        "swaps": record.swaps, "tables_published": indexer.published,
        "swap_step_seconds": [s for i, s in enumerate(step_seconds, 1) if i in swap_steps],
        "other_step_seconds": [s for i, s in enumerate(step_seconds, 1) if i not in swap_steps],
        "checkpoint_s": probe.checkpoint_s, "loop_checkpoint_s": loop_checkpoints,
    }


def micro_benchmark(trainer: Trainer, count: int) -> tuple[list[float], list[float]]:
    """``picker.pick`` + ``batches.build`` (what ``negatives_ms`` times) alone, many times:
    wall-clock and thread CPU milliseconds."""
    wall, cpu = [], []
    for _ in range(count):
        started, cpu_started = time.perf_counter(), time.thread_time()
        source, _ = trainer.picker.pick(trainer.step + 1)
        trainer.batches.build(source, None, 1)
        cpu.append((time.thread_time() - cpu_started) * 1000)
        wall.append((time.perf_counter() - started) * 1000)
    return wall, cpu


def _summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"median": statistics.median(values), "mean": statistics.fmean(values),
            "p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
            "max": ordered[-1], "n": len(values)}


def render(report: dict) -> str:
    p, m, r = report["params"], report["machine"], report["results"]
    rows = [("trainer `negatives_ms` (in the loop, wall clock)", r["negatives_ms"]),
            ("same calls in the loop, CPU time of the thread", r["negatives_cpu_ms"]),
            ("of which drawing from the table (`sample_many`), CPU time", r["sampling_cpu_ms"]),
            ("same calls, micro-benchmark, wall clock", r["micro_negatives_ms"]),
            ("same calls, micro-benchmark, CPU time", r["micro_negatives_cpu_ms"])]
    lines = [
        "# Trainer overhead of asynchronous negatives (SciFact, MiniLM)", "",
        f"Command: `{report['command']}`", "",
        f"Machine: {m['cpu']} — {m['cores']} cores, {p['threads']} torch threads, torch "
        f"{m['torch']}; {report['date']}; load average (1 min) before "
        f"{m['load_average_before'][0]:.2f}, after {m['load_average_after'][0]:.2f}", "",
        f"Params: batch {p['batch_size']} queries × (1 positive + 1 ANN negative), in-batch "
        f"negatives, {p['query_length']}/{p['doc_length']} tokens, table of {p['top_k']} "
        f"candidates × {p['train_queries']} training queries, {p['steps']} steps per run "
        f"(checkpoint every {p['refresh_every']}), {p['repeats']} runs, a new table every "
        f"{p['swap_every_s']} s.", "",
        "## (a) Obtaining negatives, per batch", "",
        "| measure | median | mean | p95 | max | n |", "|---|---:|---:|---:|---:|---:|",
        *(f"| {name} | {v['median']:.3f} ms | {v['mean']:.3f} ms | {v['p95']:.3f} ms | "
          f"{v['max']:.3f} ms | {v['n']} |" for name, v in rows), "",
        "## (b) Blocked on refreshes", "",
        f"- waits for negatives after the first table: {r['waits_after_first']} "
        f"(before step 1: {r['wait_before_first_s']:.3f} s per run, median)",
        f"- tables swapped in mid-run: {r['swaps']} over {p['repeats']} runs; median step "
        f"time on swap steps {r['swap_step_s']:.2f} s vs {r['other_step_s']:.2f} s otherwise",
        f"- in-loop checkpoint snapshot (local save; upload + announce in the background): "
        f"median {r['checkpoint_snapshot_s']:.2f} s per checkpoint = "
        f"{r['checkpoint_share']:.1%} of loop time at refresh_every {p['refresh_every']}", "",
        "## (c) Step throughput vs a plain PyTorch loop", "",
        "Steps alternate (trainer step i, then the plain loop's step i on the same batch).", "",
        "| loop | median s/step | steps/s | throughput vs plain |", "|---|---:|---:|---:|",
    ]
    for name, row in r["throughput"].items():
        lines.append(f"| {name} | {row['s_per_step']:.3f} | {row['steps_per_s']:.3f} | "
                     f"{row['ratio_vs_plain']:.3f} |")
    lines += ["", f"Median over steps of (trainer step time / plain step time on the same batch):"
              f" {r['paired_ratio_median']:.3f}. Over all steps (total plain time / total "
              f"trainer time, slow steps included): {r['throughput_vs_plain_all_steps']:.3f}."]
    return "\n".join(lines) + "\n"


def overlap_runs(args: argparse.Namespace, root: Path, redis_url: str) -> dict:
    """(d): trainer runs with the lookahead's background preparation and without,
    alternating; step 1 of every run is a warm-up."""
    runs: dict[str, list[dict]] = {"background": [], "inline": []}
    for repeat in range(args.overlap_runs):
        for mode in runs:
            run = trainer_run(args, root, redis_url, f"prefetch-{mode}-{repeat}", paired=False,
                              background=mode == "background")
            run.pop("trainer")
            runs[mode].append(run)
            print(f"(d) {mode} {repeat}: {statistics.median(run['step_seconds'][1:]):.4f} "
                  f"s/step, load {os.getloadavg()[0]:.2f}", file=sys.stderr)
    result = {}
    for mode, done in runs.items():
        steps = [s for run in done for s in run["step_seconds"][1:]]
        result[mode] = {
            "step_s": _summary(steps),
            "prepare_ms": _summary([ms for run in done for ms in run["prepare_ms"][1:]]),
            "prepare_wait_ms": _summary([ms for run in done
                                         for ms in run["prepare_wait_ms"][1:]]),
            "run_median_step_s": [statistics.median(run["step_seconds"][1:]) for run in done],
            "raw_step_seconds": [run["step_seconds"] for run in done],
        }
    on, off = result["background"]["step_s"]["median"], result["inline"]["step_s"]["median"]
    result["speedup"] = off / on
    result["saved_ms_per_step"] = (off - on) * 1000
    return result


def render_overlap(report: dict) -> str:
    p, m, d = report["params"], report["machine"], report["results"]["overlap"]
    lines = [
        "## (d) Tokenisation overlapped with the step (one-batch lookahead)", "",
        f"Model {p['model_name']}; batch {p['batch_size']} queries × (1 positive + "
        f"{p['per_query']} ANN negative(s)), in-batch negatives, {p['query_length']}/"
        f"{p['doc_length']} tokens, {p['steps']} steps per run (step 1 not counted), "
        f"{p['overlap_runs']} run(s) per mode, alternating; {p['threads']} torch thread(s); "
        f"{m['cores']} cores, load average {m['load_average_before'][0]:.2f} → "
        f"{m['load_average_after'][0]:.2f}.", "",
        "| preparation of batch s+1 | median s/step | p95 s/step | prepare_ms (median) | "
        "step waited for it, ms (median) | n |", "|---|---:|---:|---:|---:|---:|",
    ]
    for mode, name in (("background", "background thread, during step s (default)"),
                       ("inline", "on the loop's thread, before step s (sequential)")):
        r = d[mode]
        lines.append(f"| {name} | {r['step_s']['median']:.4f} | {r['step_s']['p95']:.4f} | "
                     f"{r['prepare_ms']['median']:.2f} | {r['prepare_wait_ms']['median']:.2f}"
                     f" | {r['step_s']['n']} |")
    lines += ["", f"Step time inline / background: **{d['speedup']:.3f}×** (median step "
              f"{d['saved_ms_per_step']:.1f} ms shorter with the overlap). Done inline, the "
              f"preparation takes {d['inline']['prepare_ms']['median']:.1f} ms: the most the "
              "overlap can take off a step, given a core free for the thread."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.tiny:
            from ance_train_dev.synthetic import make_tiny_bert

            args.model = str(make_tiny_bert(root / "tiny-bert"))
        redis = RedisServer(root / "redis").start()
        try:
            if args.overlap_only:
                overlap = overlap_runs(args, root, redis.url)
                return _write_overlap(args, load_before, overlap)
            for repeat in range(args.repeats):
                if runs:  # only the last run's trainer is kept (micro-benchmark)
                    runs[-1].pop("trainer")
                run = trainer_run(args, root, redis.url, f"overhead-{repeat}")
                runs.append(run)
                print(f"run {repeat}: trainer {statistics.median(run['step_seconds']):.2f} s/step"
                      f", plain {statistics.median(run['plain_step_seconds']):.2f} s/step, "
                      f"load {os.getloadavg()[0]:.2f}", file=sys.stderr)
            micro, micro_cpu = micro_benchmark(runs[-1]["trainer"], args.micro)
            overlap = overlap_runs(args, root, redis.url) if args.overlap_runs else None
        finally:
            redis.stop()

    # Step 1 of every run is a warm-up; steps are paired (trainer step i, plain step i).
    trainer_steps = [s for run in runs for s in run["step_seconds"][1:]]
    plain_steps = [s for run in runs for s in run["plain_step_seconds"][1:]]
    paired = [t / p for run in runs for t, p in zip(run["step_seconds"][1:],
                                                     run["plain_step_seconds"][1:], strict=True)]
    plain_s = statistics.median(plain_steps)
    snapshots = [t for run in runs for t in run["loop_checkpoint_s"].values()]
    snapshot_s = statistics.median(snapshots) if snapshots else 0.0
    trainer_s = statistics.median(trainer_steps)
    throughput = {
        "plain PyTorch loop": plain_s,
        "trainer, per step (step_seconds)": trainer_s,
        f"trainer incl. in-loop checkpoint snapshot every {args.refresh_every} steps":
            trainer_s + snapshot_s / args.refresh_every,
    }
    report = {
        "command": command_line(), "date": utc_now(),
        "machine": {**machine("cpu"), "load_average_before": load_before,
                    "load_average_after": os.getloadavg()},
        "params": {"model": args.model, "steps": args.steps, "refresh_every": args.refresh_every,
                   "repeats": args.repeats, "batch_size": args.batch_size,
                   "query_length": args.query_length, "doc_length": args.doc_length,
                   "top_k": args.top_k, "train_queries": runs[-1]["train_queries"],
                   "swap_every_s": args.swap_every_s, "threads": args.threads,
                   "per_query": args.per_query, "overlap_runs": args.overlap_runs,
                   "model_name": _model_name(args)},
        "results": {
            "negatives_ms": _summary([ms for run in runs for ms in run["negatives_ms"]]),
            "negatives_cpu_ms": _summary([ms for run in runs for ms in run["negatives_cpu_ms"]]),
            "sampling_cpu_ms": _summary([ms for run in runs for ms in run["sampling_cpu_ms"]]),
            "micro_negatives_ms": _summary(micro),
            "micro_negatives_cpu_ms": _summary(micro_cpu),
            "waits_after_first": sum(run["waits_after_first"] for run in runs),
            "wait_before_first_s": statistics.median(r["wait_before_first_s"] for r in runs),
            "swaps": sum(len(run["swaps"]) for run in runs),
            "swap_step_s": statistics.median(
                [s for run in runs for s in run["swap_step_seconds"]] or [0.0]),
            "other_step_s": statistics.median(
                [s for run in runs for s in run["other_step_seconds"]] or [0.0]),
            "checkpoint_snapshot_s": snapshot_s,
            "checkpoint_share": snapshot_s / (snapshot_s + args.refresh_every * trainer_s),
            "paired_ratio_median": statistics.median(paired),
            # All steps' time (slow steps after a checkpoint, whose upload runs beside them,
            # included): plain total / trainer total.
            "throughput_vs_plain_all_steps": sum(plain_steps) / sum(trainer_steps),
            "overlap": overlap,
            "throughput": {name: {"s_per_step": s, "steps_per_s": 1 / s,
                                  "ratio_vs_plain": plain_s / s}
                           for name, s in throughput.items()},
            "raw": {"trainer_step_seconds": [run["step_seconds"] for run in runs],
                    "plain_step_seconds": [run["plain_step_seconds"] for run in runs],
                    "negatives_ms": [run["negatives_ms"] for run in runs],
                    "checkpoint_s": [run["checkpoint_s"] for run in runs],
                    "swaps": [run["swaps"] for run in runs]},
        },
    }
    markdown = render(report)
    if overlap is not None:
        markdown += "\n" + render_overlap(report)
    write_report(args.out, "trainer_overhead", report, markdown)
    return 0


def _model_name(args: argparse.Namespace) -> str:
    if args.tiny:
        return "tiny random BERT (2 layers, hidden 32)"
    return "all-MiniLM-L6-v2" if args.model == default_model_path() else args.model


def _write_overlap(args: argparse.Namespace, load_before: tuple, overlap: dict) -> int:
    report = {
        "command": command_line(), "date": utc_now(),
        "machine": {**machine("cpu"), "load_average_before": load_before,
                    "load_average_after": os.getloadavg()},
        "params": {"model": args.model, "model_name": _model_name(args), "steps": args.steps,
                   "refresh_every": args.refresh_every, "batch_size": args.batch_size,
                   "per_query": args.per_query, "query_length": args.query_length,
                   "doc_length": args.doc_length, "top_k": args.top_k,
                   "overlap_runs": args.overlap_runs, "threads": args.threads},
        "results": {"overlap": overlap},
    }
    write_report(args.out, "trainer_prefetch", report,
                 f"# Trainer: tokenisation overlap\n\nCommand: `{report['command']}`\n\n"
                 f"{report['date']}\n\n" + render_overlap(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
