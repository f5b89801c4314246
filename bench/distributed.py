"""Data-parallel training on this machine: 2 gloo ranks vs 1 process, the communication share
of a step, and GradCache's peak memory, all through the trainer's own step
(``ance_train.trainer.step.backward_step`` + clip + AdamW, as ``Trainer._optimise``).

Inputs are synthetic: random WordPiece ids of a fixed token length (``--query-length``,
``--doc-length``), global batch ``--batch-size`` queries, each with its positive and one hard
negative (in-batch negatives on: every query scores all 2B documents).

(1) throughput: steps/s of the same global batch on 1 process and on 2 gloo ranks
    (``torch.multiprocessing.spawn``, 127.0.0.1), ``torch.set_num_threads(1)`` in every process
    for both, so 1 process uses 1 core and 2 ranks use 2 cores; median over ``--steps`` measured
    steps after ``--warmup``, ``--repeats`` times, alternating;
(2) communication share on 2 ranks: the time each rank is blocked in the gradient all-reduce
    (a DDP comm hook that all-reduces synchronously and times it: this serialises what DDP
    would overlap with the backward, so it is an upper bound) and in the embedding all-gather
    (forward) / its gradient all-reduce (backward) and the loss all-reduce (the python
    collectives of ``trainer/distributed.py``, timed by wrapping ``torch.distributed``);
    blocked time includes waiting for the slower rank;
(3) GradCache memory: peak RSS (``ru_maxrss``) of one process doing one step at global batch
    ``--memory-batch`` with ``--memory-doc-length``-token documents, plain vs GradCache chunk
    ``--chunk``, each in a fresh subprocess, against ``--cap-gib``.

    python bench/distributed.py            # all-MiniLM-L6-v2
    python bench/distributed.py --tiny     # a 2-layer hidden-32 BERT, a quick run

Writes ``distributed.json`` / ``distributed.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ance_train.config import ModelConfig
from ance_train.modeling.model import BiEncoder
from ance_train.modeling.precision import autocast_context
from ance_train.trainer.batches import TrainingBatch
from ance_train.trainer.distributed import DistributedContext, init_from_env, shard_batch
from ance_train.trainer.step import PairEncoder, backward_step, data_parallel

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
    parser.add_argument("--tiny", action="store_true", help="a tiny random BERT instead")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch (queries)")
    parser.add_argument("--query-length", type=int, default=16)
    parser.add_argument("--doc-length", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per repeat")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--memory-batch", type=int, default=64)
    parser.add_argument("--memory-doc-length", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=8, help="GradCache chunk (rows)")
    parser.add_argument("--cap-gib", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks")
    parser.add_argument("--memory-child", choices=["plain", "gradcache"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def synthetic_batch(size: int) -> TrainingBatch:
    """B queries, column i = query i's positive, column B + i its hard negative."""
    return TrainingBatch(
        query_ids=[f"q{i}" for i in range(size)], query_texts=[f"q{i}" for i in range(size)],
        doc_indices=list(range(2 * size)), positive_column=torch.arange(size),
        allowed=torch.ones(size, 2 * size, dtype=torch.bool), hard_negatives=size,
        dual_query_texts=[], dual_allowed=None, negatives_per_query=[1] * size,
        dual_per_query=[0] * size)


def token_ids(count: int, length: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, vocab, (count, length), generator=gen)
    ids[:, 0], ids[:, -1] = 101, 102  # [CLS] ... [SEP]
    return ids, torch.ones_like(ids)


class Step:
    """The trainer's step on a fixed synthetic global batch, for this rank."""

    def __init__(self, model_dir: str, context: DistributedContext, batch: int, qlen: int,
                 dlen: int, chunk: int | None = None) -> None:
        torch.manual_seed(0)
        self.context, self.chunk = context, chunk
        self.model = BiEncoder.from_pretrained(model_dir, ModelConfig(path=model_dir))
        self.encoder = data_parallel(PairEncoder(self.model), context)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.shard = shard_batch(synthetic_batch(batch), context.rank, context.world_size)
        vocab = self.model.encoder.config.vocab_size
        qids, dids = self.shard.rows, self.shard.doc_indices
        self.queries = token_ids(len(qids), qlen, vocab, seed=qids.start)
        self.docs = token_ids(len(dids), dlen, vocab, seed=10_000 + dids[0])
        self.autocast = lambda: autocast_context("off", torch.device("cpu"))

    def __call__(self) -> float:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss, _ = backward_step(self.encoder, self.shard, self.queries, self.docs,
                                self.context, 0.0, self.autocast, self.chunk)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 2.0)
        self.optimizer.step()
        return loss


class CommTimer:
    """Blocked time in collectives: DDP's gradient buckets (a synchronous comm hook) and the
    python collectives of ``trainer/distributed.py`` (``dist.all_gather`` / ``all_reduce``)."""

    def __init__(self) -> None:
        self.grad = 0.0
        self.gather = 0.0
        self._all_gather, self._all_reduce = dist.all_gather, dist.all_reduce

    def install(self, ddp: torch.nn.Module) -> None:
        def all_gather(*a, **k):
            t = time.perf_counter()
            out = self._all_gather(*a, **k)
            self.gather += time.perf_counter() - t
            return out

        def all_reduce(*a, **k):
            t = time.perf_counter()
            out = self._all_reduce(*a, **k)
            self.gather += time.perf_counter() - t
            return out

        dist.all_gather, dist.all_reduce = all_gather, all_reduce

        def hook(state, bucket):
            t = time.perf_counter()
            buffer = bucket.buffer()
            self._all_reduce(buffer)
            buffer.div_(dist.get_world_size())
            self.grad += time.perf_counter() - t
            future = torch.futures.Future()
            future.set_result(buffer)
            return future

        ddp.register_comm_hook(None, hook)

    def reset(self) -> None:
        self.grad = self.gather = 0.0


def rank_main(rank: int, world: int, port: int, cfg: dict, out: str) -> None:
    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    context = init_from_env("gloo")
    step = Step(cfg["model"], context, cfg["batch"], cfg["qlen"], cfg["dlen"])

    def barrier() -> None:
        if world > 1:
            dist.barrier()

    def timed(n: int) -> list[float]:
        times = []
        for _ in range(n):
            barrier()
            t = time.perf_counter()
            step()
            barrier()
            times.append(time.perf_counter() - t)
        return times

    timed(cfg["warmup"])
    result: dict = {"step_s": timed(cfg["steps"])}
    if world > 1 and cfg["comm"]:
        timer = CommTimer()
        timer.install(step.encoder)
        timed(1)
        steps, grad, gather = [], [], []
        for _ in range(cfg["steps"]):
            timer.reset()
            steps += timed(1)
            grad.append(timer.grad)
            gather.append(timer.gather)
        result.update(comm_step_s=steps, grad_allreduce_s=grad, gather_s=gather)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, cfg: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(world, free_port(), cfg, out), nprocs=world, join=True)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def memory_child(args: argparse.Namespace) -> None:
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    chunk = args.chunk if args.memory_child == "gradcache" else None
    step = Step(args.model_dir, DistributedContext(), args.memory_batch, args.query_length,
                args.memory_doc_length, chunk)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t = time.perf_counter()
    loss = step()
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak_rss_bytes": peak, "before_step_bytes": before,
                      "step_s": seconds, "loss": loss}))


def memory_run(args: argparse.Namespace, model_dir: str, variant: str) -> dict:
    command = [sys.executable, __file__, "--memory-child", variant, "--model-dir", model_dir,
               "--memory-batch", str(args.memory_batch), "--query-length",
               str(args.query_length), "--memory-doc-length", str(args.memory_doc_length),
               "--chunk", str(args.chunk)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


GIB = 1024 ** 3


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.memory_child:
        memory_child(args)
        return
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(args.model)
        if args.tiny:
            from ance_train_dev.synthetic import make_tiny_bert

            model_dir = str(make_tiny_bert(Path(tmp) / "tiny"))
        cfg = {"model": model_dir, "batch": args.batch_size, "qlen": args.query_length,
               "dlen": args.doc_length, "warmup": args.warmup, "steps": args.steps,
               "comm": False}
        one, two = [], []
        for _ in range(args.repeats):  # alternating, so both see the same machine drift
            one.append(statistics.median(run_world(1, cfg)[0]["step_s"]))
            ranks = run_world(2, cfg)
            two.append(statistics.median(max(a, b) for a, b in
                                         zip(ranks[0]["step_s"], ranks[1]["step_s"],
                                             strict=True)))
        comm = run_world(2, {**cfg, "comm": True})
        memory = {v: memory_run(args, model_dir, v) for v in ("plain", "gradcache")}
    per_rank = []
    for r, res in enumerate(comm):
        step = statistics.median(res["comm_step_s"])
        grad = statistics.median(res["grad_allreduce_s"])
        gather = statistics.median(res["gather_s"])
        per_rank.append({"rank": r, "step_s": step, "grad_allreduce_s": grad,
                         "gather_s": gather, "share": (grad + gather) / step})
    share = statistics.mean(p["share"] for p in per_rank)
    sps1 = [1 / s for s in one]
    sps2 = [1 / s for s in two]
    ratio = statistics.median(sps2) / statistics.median(sps1)
    cap = args.cap_gib * GIB
    report = {
        "benchmark": "distributed", "date": utc_now(), "command": command_line(),
        "machine": machine(), "model": "tiny BERT (2 layers, hidden 32)" if args.tiny
        else str(args.model),
        "inputs": f"synthetic random token ids, queries {args.query_length} tokens, documents "
                  f"{args.doc_length} tokens; global batch {args.batch_size} queries, "
                  "1 hard negative each, in-batch negatives",
        "threads": "torch.set_num_threads(1) in every process (1 process: 1 core; 2 ranks: "
                   "2 cores)",
        "args": {k: str(v) for k, v in vars(args).items() if k not in ("memory_child",
                                                                         "model_dir")},
        "throughput": {"one_process_step_s": one, "two_ranks_step_s": two,
                       "one_process_steps_per_s": sps1, "two_ranks_steps_per_s": sps2,
                       "ratio_2_vs_1": ratio},
        "communication": {"per_rank": per_rank, "share": share},
        "memory": {"cap_bytes": cap, "batch": args.memory_batch,
                   "doc_length": args.memory_doc_length, "chunk": args.chunk, **memory,
                   "plain_over_cap": memory["plain"]["peak_rss_bytes"] > cap,
                   "gradcache_under_cap": memory["gradcache"]["peak_rss_bytes"] <= cap},
        "total_s": time.perf_counter() - started,
    }
    write_report(args.out, "distributed", report, markdown(report))


def markdown(r: dict) -> str:
    t, c, m = r["throughput"], r["communication"], r["memory"]
    fmt = ", ".join
    lines = [
        "# Data-parallel training: 2 ranks vs 1, communication, GradCache memory", "",
        f"{r['date']} · `{r['command']}` · {r['machine']['cpu']}, {r['machine']['cores']} "
        f"cores, no GPU · torch {r['machine']['torch']} · total {r['total_s']:.0f} s", "",
        f"Model: {r['model']}. Inputs: {r['inputs']}. Step: the trainer's "
        "`backward_step` + gradient clipping + AdamW. Threads: "
        f"{r['threads']}.", "",
        "## Step throughput, same global batch", "",
        "| | median step (s), per repeat | steps/s |", "|---|---|---|",
        f"| 1 process | {fmt(f'{s:.3f}' for s in t['one_process_step_s'])} | "
        f"{fmt(f'{s:.3f}' for s in t['one_process_steps_per_s'])} |",
        f"| 2 gloo ranks | {fmt(f'{s:.3f}' for s in t['two_ranks_step_s'])} | "
        f"{fmt(f'{s:.3f}' for s in t['two_ranks_steps_per_s'])} |", "",
        f"2 ranks / 1 process: **{t['ratio_2_vs_1']:.2f}×** (medians). This machine has 2 "
        "cores, so 2 ranks also means twice the cores; the ideal is 2×.", "",
        "## Communication share (2 ranks)", "",
        "| rank | step (s) | gradient all-reduce (s) | gather + its backward + loss (s) "
        "| share |", "|---|---|---|---|---|",
        *[f"| {p['rank']} | {p['step_s']:.3f} | {p['grad_allreduce_s']:.3f} | "
          f"{p['gather_s']:.3f} | {p['share']:.1%} |" for p in c["per_rank"]], "",
        f"Mean share: **{c['share']:.1%}** of a step blocked in collectives. The gradient "
        "all-reduce is timed by a synchronous DDP comm hook (no overlap with the backward, so "
        "an upper bound), the rest by wrapping `torch.distributed.all_gather`/`all_reduce`; "
        "blocked time includes waiting for the other rank.", "",
        "## GradCache peak memory (1 process, one step)", "",
        f"Global batch {m['batch']} queries + {2 * m['batch']} documents of "
        f"{m['doc_length']} tokens; cap **{m['cap_bytes'] / GIB:.1f} GiB** peak RSS "
        "(`ru_maxrss`, each variant in a fresh subprocess, all cores).", "",
        "| variant | peak RSS (GiB) | RSS before the step (GiB) | step (s) | under cap |",
        "|---|---|---|---|---|",
        *[f"| {name} | {m[v]['peak_rss_bytes'] / GIB:.2f} | "
          f"{m[v]['before_step_bytes'] / GIB:.2f} | {m[v]['step_s']:.1f} | "
          f"{'yes' if m[v]['peak_rss_bytes'] <= m['cap_bytes'] else 'no'} |"
          for name, v in (("plain", "plain"), (f"GradCache chunk {m['chunk']}", "gradcache"))],
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
