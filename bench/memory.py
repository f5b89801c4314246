"""Peak memory of each service at two corpus sizes, through the real embedded run.

For each size a synthetic BEIR corpus of short documents (``ance_train_dev.synthetic.write_beir``,
the dev harness; the same queries count at every size) is trained on by ``ance-train run``
with a tiny randomly initialised BERT (2 layers, hidden 32) whose projection head gives 384-d
embeddings, so encoding is fast but the index has a real embedding size. The run does two
refreshes (checkpoint 0 and the final one). Every service is its own OS process; the peak
RSS of each is read from the kernel's high-water mark (``VmHWM`` in ``/proc/<pid>/status``,
polled until the process exits, so no short peak is missed).

Expected if memory is bounded as designed: the inferencers' and the trainer's peaks do not
grow with the corpus (an inferencer holds one shard, the trainer one batch; texts are read
through the byte-offset index), and the indexer's grows by what ``ance-train plan``
predicts from the index size. The refresh period measured at the larger size is compared
with ``plan``'s prediction from the smaller run's measured throughput.

    python bench/memory.py --sizes 20000 200000

Writes ``memory.json`` and ``memory.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

from ance_train.config import IndexConfig
from ance_train.index import capacity

from ance_train_dev.report import command_line, machine, utc_now, write_report
from ance_train_dev.synthetic import make_tiny_bert, write_beir

REPO = Path(__file__).resolve().parents[1]

POLL_S = 0.2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs=2, type=int, default=[20_000, 200_000])
    parser.add_argument("--train-queries", type=int, default=1000)
    parser.add_argument("--test-queries", type=int, default=200)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--dim", type=int, default=384, help="projection head output")
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument("--max-minutes", type=float, default=20.0, help="per run")
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks")
    return parser.parse_args(argv)


def run_config(root: Path, size: int, args: argparse.Namespace, model: Path) -> Path:
    config = {
        "run_id": f"memory-{size}", "output_dir": str(root / "runs"),
        "data": {"path": str(root / "data"), "dev_max_queries": 100},
        "model": {"path": str(model), "projection_dim": args.dim, "similarity": "cosine",
                  "max_query_length": 16, "max_doc_length": 48},
        "training": {"steps": 2, "refresh_every": 2, "batch_size": 8, "warmup_steps": 0,
                     "torch_threads": 1},
        # No BM25 warm-up: bm25s indexes the whole corpus in memory (see memory.md).
        "negatives": {"pool": "ann", "warmup": "none"},
        "inference": {"replicas": args.replicas, "shard_size": args.shard_size,
                      "batch_size": 64, "torch_threads": 1},
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _status(pid: int) -> dict[str, int]:
    """VmHWM / VmRSS of a process in bytes ({} once it has exited)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith(("VmHWM:", "VmRSS:")):
            name, value = line.split(":")
            out[name] = int(value.split()[0]) * 1024
    return out


def _name(process: psutil.Process) -> str | None:
    """``trainer`` / ``indexer`` / ``inferencer-0`` for a service, ``redis`` / None otherwise."""
    try:  # a service forked by the zygote has its command as one string (its process title)
        cmd = " ".join(process.cmdline()).split()
    except psutil.Error:
        return None
    if "serve" in cmd and "--instance" in cmd:
        return cmd[cmd.index("--instance") + 1]
    return "redis" if any("redis-server" in part for part in cmd) else None


def watch(command: list[str], log: Path, limit_s: float) -> dict[str, int]:
    """Run ``command``; return the peak RSS (VmHWM) of it and of each named descendant."""
    peaks: dict[str, int] = {}
    with open(log, "wb") as out:
        launcher = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        root = psutil.Process(launcher.pid)
        deadline = time.monotonic() + limit_s
        while launcher.poll() is None:
            if time.monotonic() > deadline:
                launcher.terminate()
                launcher.wait()
                raise RuntimeError(f"run exceeded {limit_s:.0f}s; see {log}")
            named = [(_name(p), p.pid) for p in root.children(recursive=True)]
            for name, pid in [("launcher", launcher.pid), *named]:
                hwm = _status(pid).get("VmHWM")
                if name and hwm:
                    peaks[name] = max(peaks.get(name, 0), hwm)
            time.sleep(POLL_S)
    if launcher.returncode != 0:
        raise RuntimeError(f"run failed ({launcher.returncode}); see {log}:\n"
                           + log.read_text(errors="replace")[-3000:])
    return peaks


def refresh_timings(run_dir: Path, run_id: str) -> list[dict]:
    """Per refresh, from the store's file times: checkpoint saved → first/last corpus shard →
    negatives written; plus the indexer's own stage timings (eval/<k>.json)."""
    store = run_dir / "store" / run_id
    out = []
    for manifest in sorted((store / "checkpoints").glob("*/MANIFEST.json"),
                           key=lambda p: int(p.parent.name)):
        step = manifest.parent.name
        shards = sorted(p.stat().st_mtime for p in (store / "embeddings" / step).glob(
            "corpus-*.npz"))
        negatives = store / "negatives" / f"{step}.npz"
        evaluation = json.loads((store / "eval" / f"{step}.json").read_text())
        saved = manifest.stat().st_mtime
        out.append({"step": int(step), "encode_s": shards[-1] - saved,
                    "first_shard_s": shards[0] - saved,
                    "refresh_s": negatives.stat().st_mtime - saved,
                    "indexer": evaluation["timings"]})
    return out


def measure(size: int, args: argparse.Namespace, model: Path, workdir: Path) -> dict:
    root = workdir / f"size-{size}"
    root.mkdir()
    started = time.monotonic()
    write_beir(root / "data", size, args.train_queries, args.test_queries)
    corpus_bytes = (root / "data" / "corpus.jsonl").stat().st_size
    config = run_config(root, size, args, model)
    load_before = os.getloadavg()
    print(f"{size}: data in {time.monotonic() - started:.0f}s; running", file=sys.stderr)
    started = time.monotonic()
    peaks = watch([sys.executable, "-m", "ance_train.cli", "run", "--config", str(config)],
                  root / "run.log", args.max_minutes * 60)
    run_s = time.monotonic() - started
    run_dir = root / "runs" / f"memory-{size}"
    refreshes = refresh_timings(run_dir, f"memory-{size}")
    steady = refreshes[-1]  # refresh 0 also waits for the services to start
    dataset = json.loads((run_dir / "cache" / "dataset.json").read_text())
    return {"size": size, "corpus_bytes": corpus_bytes, "peak_rss": peaks, "run_s": run_s,
            "refreshes": refreshes, "load1_before": load_before[0],
            "queries": {split: len(dataset[split]) for split in ("train", "dev", "test")},
            "tokens": mean_tokens(root / "data", model),
            "load1_after": os.getloadavg()[0],
            # corpus throughput of one replica in the last refresh (checkpoint saved → last
            # shard written, so checkpoint download and upload included)
            "docs_per_s_per_replica": size / steady["encode_s"] / args.replicas}


def mean_tokens(data: Path, model: Path, sample: int = 2000) -> dict[str, float]:
    """Mean tokens (after truncation to the run's lengths) of documents and queries."""
    from ance_train.modeling.model import load_tokenizer

    tokenizer = load_tokenizer(model)
    out = {}
    for name, limit in (("corpus", 48), ("queries", 16)):
        with open(data / f"{name}.jsonl", encoding="utf-8") as lines:
            texts = [json.loads(line)["text"] for line, _ in zip(lines, range(sample),
                                                                  strict=False)]
        ids = tokenizer(texts, truncation=True, max_length=limit)["input_ids"]
        out[name] = sum(map(len, ids)) / len(ids)
    return out


def model_params(model: Path, dim: int, hidden: int = 32) -> int:
    """Parameters of the tiny encoder plus the projection head (Linear + LayerNorm)."""
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), "np") as weights:
        encoder = sum(math.prod(weights.get_slice(key).get_shape())
                      for key in weights.keys())  # noqa: SIM118 - not a mapping
    return encoder + hidden * dim + dim + 2 * dim


def predictions(runs: list[dict], args: argparse.Namespace, params: int) -> dict:
    """``plan`` for each size, with the smaller run's measured per-replica throughput."""
    small = runs[0]
    out = {}
    for run in runs:
        q = run["queries"]
        load = capacity.Workload(
            docs=run["size"], dim=args.dim, replicas=args.replicas,
            docs_per_s=small["docs_per_s_per_replica"], train_queries=q["train"],
            eval_queries=q["dev"] + q["test"], doc_tokens=round(run["tokens"]["corpus"]),
            query_tokens=round(run["tokens"]["queries"]), shard_size=args.shard_size,
            mine_depth=201, model_params=params, index=IndexConfig())
        result = capacity.plan(load)
        out[str(run["size"])] = {"refresh_s": result.refresh_s, "seconds": result.seconds,
                                 "index_bytes": result.index_bytes,
                                 "indexer_bytes": result.indexer_bytes}
    return out


def render_markdown(report: dict) -> str:
    p, m = report["params"], report["machine"]
    small, large = report["runs"]
    names = sorted(set(small["peak_rss"]) | set(large["peak_rss"]),
                   key=lambda n: (n.startswith("inferencer"), n))
    pred = report["plan"]
    lines = [
        "# Peak memory of each service at two corpus sizes", "",
        f"Command: `{report['command']}`", "",
        f"Machine: {m['cpu']} — {m['cores']} cores, {m['platform']}; {report['date']}. "
        f"Load average (1 min) before the runs: {small['load1_before']:.2f} and "
        f"{large['load1_before']:.2f} (shared machine).", "",
        f"Runs: `ance-train run`, tiny BERT (2 layers, hidden 32) + projection to "
        f"{p['dim']}-d, cosine, {p['replicas']} inferencers, shards of {p['shard_size']} "
        f"documents, {p['train_queries']} train / {p['test_queries']} test queries at both "
        "sizes, 2 training steps, 2 refreshes (checkpoints 0 and 2), flat index, no BM25 "
        "warm-up. Peak RSS = the kernel's `VmHWM` of each process.", "",
        f"| process | peak RSS, {small['size']:,} docs (MB) | peak RSS, {large['size']:,} docs "
        "(MB) | growth (MB) |", "|---|---:|---:|---:|"]
    for name in names:
        a, b = small["peak_rss"].get(name, 0), large["peak_rss"].get(name, 0)
        lines.append(f"| {name} | {a / 1e6:.0f} | {b / 1e6:.0f} | {(b - a) / 1e6:+.0f} |")
    growth_index = pred[str(large["size"])]["index_bytes"] - pred[str(small["size"])][
        "index_bytes"]
    growth_set = pred[str(large["size"])]["indexer_bytes"] - pred[str(small["size"])][
        "indexer_bytes"]
    lines += ["", f"Corpus text: {small['corpus_bytes'] / 1e6:.0f} MB and "
              f"{large['corpus_bytes'] / 1e6:.0f} MB (growth "
              f"{(large['corpus_bytes'] - small['corpus_bytes']) / 1e6:+.0f} MB). `plan`: "
              f"index growth {growth_index / 1e6:+.0f} MB; indexer working set growth "
              f"(two indexes while the previous one keeps serving, queries, results, "
              f"negatives) {growth_set / 1e6:+.0f} MB.", "",
              "## Refresh period: measured vs `ance-train plan`", "",
              f"`plan` inputs: the {small['size']:,}-doc run's measured corpus throughput "
              f"({small['docs_per_s_per_replica']:.0f} docs/s per replica, last refresh), "
              "built-in index "
              "rates, 200 MB/s store.", "",
              "| docs | refresh | measured s (ckpt saved → negatives written) | encode s "
              "(measured) | indexer build / mine / eval s (measured) | plan s | plan / "
              "measured |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for run in (small, large):
        planned = pred[str(run["size"])]["refresh_s"]
        for r in run["refreshes"]:
            t = r["indexer"]
            steady = r is run["refreshes"][-1]
            ratio = f"{planned / r['refresh_s']:.2f}" if steady else "— (start-up)"
            lines.append(f"| {run['size']:,} | {r['step']} | {r['refresh_s']:.1f} | "
                         f"{r['encode_s']:.1f} | {t['build_s']:.1f} / {t['mine_s']:.1f} / "
                         f"{t['eval_s']:.1f} | {planned:.1f} | {ratio} |")
    lines += ["", "Refresh 0 starts while the services are still loading, so only the last "
              "refresh is compared; at the smaller size the comparison is in-sample (its "
              "throughput is `plan`'s input)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        workdir = Path(tmp)
        model = make_tiny_bert(workdir / "tiny-bert")
        params = model_params(model, args.dim)
        runs = [measure(size, args, model, workdir) for size in sorted(args.sizes)]
    report = {"command": command_line(), "date": utc_now(), "machine": machine("cpu"),
              "params": {k: v for k, v in vars(args).items() if k != "out"}, "runs": runs}
    report["plan"] = predictions(runs, args, params)
    write_report(args.out, "memory", report, render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
