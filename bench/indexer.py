"""Indexer cost per refresh: build the index, search top-K for every training query, mine.

Synthetic clustered 384-d embeddings (a Gaussian mixture of N/100 unit centres, normalised;
queries drawn next to random corpus points, which are their positives), at each corpus size.
For each index type (``ance_train.index.ann.AnnIndex``, the indexer's own class) one
child process reads the corpus shard by shard (as the indexer reads embedding shards),
builds the index, searches the training queries to the mining depth in batches (the
indexer's path), runs ``Miner.mine`` (the indexer's mining code) and reports its peak RSS
(``VmHWM``). Recall@10/@100 is measured against ``flat`` (exact) of the same run; times
are also given as ratios to ``flat`` of the same run, since the machine is shared.

The capacity model of ``ance-train plan`` (``ance_train.index.capacity``) is fitted on the
smallest size (ops per second of each type and phase) and its predictions are checked on
the larger sizes; its index-memory model is checked against the serialised FAISS index.

    python bench/indexer.py --sizes 100000 1000000 --queries 2000 \\
        --nlist 1000000=1000 --hnsw-max-docs 100000

Writes ``indexer.json``, ``indexer.md`` and ``indexer.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ance_train.config import IndexConfig, NegativesConfig
from ance_train.data.dataset import DatasetIndex
from ance_train.index import capacity
from ance_train.index.ann import AnnIndex, recall_at
from ance_train.negatives.mining import Miner

from ance_train_dev.report import command_line, machine, utc_now, write_report
from ance_train_dev.synthetic import clustered_vectors, queries_near

REPO = Path(__file__).resolve().parents[1]

TYPES = ["flat", "ivf", "ivfpq", "hnsw"]
SHARD = 10_000  # vectors per read (the indexer reads one embedding shard at a time)
TRUTH_DEPTH = 100


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[100_000])
    parser.add_argument("--queries", type=int, default=2000, help="training queries mined")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--types", nargs="+", choices=TYPES, default=TYPES)
    parser.add_argument("--nlist", nargs="*", default=[], metavar="SIZE=NLIST",
                        help="index.ivf.nlist for a size (default: 4·sqrt(N), the config's)")
    parser.add_argument("--hnsw-max-docs", type=int, default=100_000,
                        help="skip hnsw above this size (its build is slow on 2 cores)")
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks")
    parser.add_argument("--from-json", type=Path,
                        help="re-analyse a measured indexer.json instead of measuring")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- child: one index type at one size ------------------------------------------------------
def read_shards(path: Path, count: int, dim: int):
    """Yield (ids, vectors) from a raw float32 file, one shard at a time (plain reads)."""
    with open(path, "rb") as handle:
        for start in range(0, count, SHARD):
            rows = min(SHARD, count - start)
            vectors = np.fromfile(handle, dtype=np.float32, count=rows * dim).reshape(rows, dim)
            yield np.arange(start, start + rows, dtype=np.int64), vectors


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_rss() -> int:
    """This process's RSS high-water mark (``VmHWM``; ``ru_maxrss`` would carry the parent's
    peak across ``fork`` + ``exec``)."""
    return _status_bytes("VmHWM")


def current_rss() -> int:
    return _status_bytes("VmRSS")


def run_worker(task_path: Path) -> None:
    task = json.loads(task_path.read_text())
    data, size, dim = Path(task["data"]), task["size"], task["dim"]
    config = IndexConfig.model_validate(task["index"])
    queries = np.load(data / "queries.npy")
    positives = np.load(data / "positives.npy")
    train_ids = [f"q{i}" for i in range(len(queries))]
    dataset = DatasetIndex(format="beir", num_docs=size,
                           train={q: {int(p): 1} for q, p in zip(train_ids, positives,
                                                                  strict=True)})
    miner = Miner(NegativesConfig(), 1.0, dataset, train_ids, seed=0)
    # As Announcer.train_depth (indexer/announce.py).
    depth = max(100, miner.depth()) + miner.max_positives
    baseline = current_rss()

    started = time.perf_counter()
    index = AnnIndex(dim, config, "cosine", expected_size=size)
    for ids, vectors in read_shards(data / "corpus.f32", size, dim):
        index.add(ids, vectors)
    index.finalize()
    build_s = time.perf_counter() - started
    after_build = current_rss()

    started = time.perf_counter()
    ranked, sims = index.search(queries, depth, batch_size=1024)
    search_s = time.perf_counter() - started
    started = time.perf_counter()
    table = miner.mine(0, index, queries, ranked, sims, previous=None)
    mine_s = time.perf_counter() - started
    peak = peak_rss()
    np.save(task["top"], ranked[:, :TRUTH_DEPTH])
    result = {"type": config.type, "size": size, "nlist": index.nlist, "depth": depth,
              "build_s": build_s, "search_s": search_s, "mine_s": mine_s,
              "negatives_per_query": float((table.candidates >= 0).sum(1).mean()),
              "baseline_rss": baseline, "rss_after_build": after_build, "peak_rss": peak,
              "index_nbytes": index.nbytes(),
              "index_bytes_model": capacity.index_bytes(config, size, dim),
              "positive_found": float(np.mean([p in r for p, r in zip(positives, ranked,
                                                                      strict=True)]))}
    Path(task["result"]).write_text(json.dumps(result))


# -- parent ---------------------------------------------------------------------------------
def write_data(directory: Path, size: int, dim: int, queries: int, seed: int) -> None:
    rng = np.random.default_rng([seed, size])
    corpus = clustered_vectors(size, dim, clusters=max(10, size // 100), rng=rng, spread=0.8)
    corpus.tofile(directory / "corpus.f32")
    query_vectors, positives = queries_near(corpus, queries, rng)
    np.save(directory / "queries.npy", query_vectors)
    np.save(directory / "positives.npy", positives)


def index_settings(kind: str, size: int, nlists: dict[int, int], device: str) -> dict:
    settings: dict = {"type": kind, "device": device}
    if kind in ("ivf", "ivfpq") and size in nlists:
        settings["ivf"] = {"nlist": nlists[size]}
    return settings


def run_child(directory: Path, size: int, dim: int, settings: dict) -> dict:
    kind = settings["type"]
    task = {"data": str(directory), "size": size, "dim": dim, "index": settings,
            "top": str(directory / f"top-{kind}.npy"),
            "result": str(directory / f"result-{kind}.json")}
    task_path = directory / f"task-{kind}.json"
    task_path.write_text(json.dumps(task))
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--worker", str(task_path)], check=True)
    result = json.loads(Path(task["result"]).read_text())
    result.update(wall_s=time.perf_counter() - started, index=settings,
                  load1_before=load_before, load1_after=os.getloadavg()[0])
    return result


def fit_rates(rows: list[dict], dim: int, queries: int) -> dict[str, float]:
    """Ops per second of each type/phase (and mining cells per second) from one size."""
    rates: dict[str, float] = {}
    for row in rows:
        cfg = IndexConfig.model_validate(row["index"])
        n = row["size"]
        rates[f"{row['type']}/build"] = capacity.index_work(cfg, "build", n, dim) / row["build_s"]
        rates[f"{row['type']}/search"] = capacity.index_work(
            cfg, "search", n, dim, queries, row["depth"]) / row["search_s"]
    # Mining does not depend on the index type: the median over the types.
    rates["mine"] = float(np.median([queries * r["depth"] / r["mine_s"] for r in rows]))
    return rates


def predict(row: dict, rates: dict[str, float], dim: int, queries: int) -> dict[str, float]:
    cfg = IndexConfig.model_validate(row["index"])
    n, kind = row["size"], row["type"]
    return {"build_s": capacity.index_work(cfg, "build", n, dim) / rates[f"{kind}/build"],
            "search_s": capacity.index_work(cfg, "search", n, dim, queries, row["depth"])
            / rates[f"{kind}/search"],
            "mine_s": queries * row["depth"] / rates["mine"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args.worker)
        return 0
    if args.from_json:  # recompute the derived values and the outputs of a measured run
        write(analyse(json.loads(args.from_json.read_text())), args.out)
        return 0
    nlists = {int(k): int(v) for k, v in (item.split("=") for item in args.nlist)}
    rows: list[dict] = []
    load_start = os.getloadavg()
    for size in args.sizes:
        with tempfile.TemporaryDirectory(prefix="bench-indexer-") as tmp:
            directory = Path(tmp)
            started = time.perf_counter()
            write_data(directory, size, args.dim, args.queries, args.seed)
            print(f"{size}: data in {time.perf_counter() - started:.0f}s", file=sys.stderr)
            kinds = ["flat"] + [k for k in args.types if k != "flat"]
            for kind in kinds:
                if kind == "hnsw" and size > args.hnsw_max_docs:
                    continue
                row = run_child(directory, size, args.dim,
                                index_settings(kind, size, nlists, args.device))
                truth = np.load(directory / "top-flat.npy")
                found = np.load(directory / f"top-{kind}.npy")
                row["recall@10"] = recall_at(found, truth, 10)
                row["recall@100"] = recall_at(found, truth, 100)
                rows.append(row)
                print(f"{size} {kind}: build {row['build_s']:.1f}s search {row['search_s']:.1f}s"
                      f" mine {row['mine_s']:.1f}s recall@10 {row['recall@10']:.3f} "
                      f"peak {row['peak_rss'] / 1e9:.2f} GB", file=sys.stderr)
    report = {"command": command_line(), "date": utc_now(),
              "machine": {**machine(args.device), "load_average_start": load_start,
                          "load_average_end": os.getloadavg()},
              "params": {"sizes": args.sizes, "queries": args.queries, "dim": args.dim,
                         "shard": SHARD, "clusters": "N/100", "spread": 0.8,
                         "hnsw_max_docs": args.hnsw_max_docs, "nlist": nlists,
                         "seed": args.seed},
              "results": rows}
    write(analyse(report), args.out)
    return 0


def analyse(report: dict) -> dict:
    """Derived values: ratios to flat, the plan model fitted at the smallest size and its
    predictions, rates at every size, and prediction ratios normalised by flat's search
    ratio at the same size (which cancels a change of the machine's load between sizes)."""
    rows, p = report["results"], report["params"]
    dim, queries = p["dim"], p["queries"]
    for row in rows:
        flat = next(r for r in rows if r["size"] == row["size"] and r["type"] == "flat")
        total = row["build_s"] + row["search_s"] + row["mine_s"]
        row["total_s"] = total
        row["total_vs_flat"] = total / (flat["build_s"] + flat["search_s"] + flat["mine_s"])
        row["search_vs_flat"] = row["search_s"] / flat["search_s"]
    sizes = sorted({r["size"] for r in rows})
    rates = fit_rates([r for r in rows if r["size"] == sizes[0]], dim, queries)
    for row in rows:
        row["predicted"] = predict(row, rates, dim, queries)
        row["predicted_vs_measured"] = {k: row["predicted"][k] / row[k]
                                        for k in ("build_s", "search_s", "mine_s")}
    for row in rows:
        flat = next(r for r in rows if r["size"] == row["size"] and r["type"] == "flat")
        speed = flat["predicted_vs_measured"]["search_s"]
        row["normalised"] = {k: v / speed for k, v in row["predicted_vs_measured"].items()}
    report["fit"] = {"size": sizes[0], "rates": rates}
    report["rates_by_size"] = {str(size): fit_rates([r for r in rows if r["size"] == size],
                                                    dim, queries) for size in sizes}
    return report


def write(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    plot(report, out / "indexer.png")
    write_report(out, "indexer", report, render_markdown(report))


def _gb(value: float) -> str:
    return f"{value / 1e9:.2f}"


def render_markdown(report: dict) -> str:
    p, m = report["params"], report["machine"]
    fit = report["fit"]["size"]
    lines = [
        "# Indexer: build, search and mining per refresh", "",
        f"Command: `{report['command']}`", "",
        f"Machine: {m['cpu']} — {m['cores']} cores, GPU: {m['gpu'] or 'none'}, "
        f"{m['platform']}; {report['date']}. Load average (1 min) at start "
        f"{m['load_average_start'][0]:.2f}, at end {m['load_average_end'][0]:.2f} "
        "(shared machine; per-row values below).", "",
        f"Data: {p['dim']}-d clustered synthetic embeddings (N/100 Gaussian clusters, "
        f"normalised), {p['queries']} training queries near random documents, mining depth "
        "201 (ANCE top-200 + positive), cosine. Recall is against `flat` of the same size. "
        "Times are seconds; `× flat` = (build + search + mine) relative to flat in the same "
        "run. RSS in GB (peak = `VmHWM` of the child; baseline = before reading vectors).",
        "",
        "| docs | type | nlist | build s | search s | mine s | × flat | recall@10 | "
        "recall@100 | index GB (FAISS) | index GB (plan) | baseline RSS | peak RSS | load1 |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['size']:,} | {r['type']} | {r['nlist'] or '—'} | {r['build_s']:.1f} | "
            f"{r['search_s']:.1f} | {r['mine_s']:.1f} | {r['total_vs_flat']:.2f} | "
            f"{r['recall@10']:.3f} | {r['recall@100']:.3f} | {_gb(r['index_nbytes'])} | "
            f"{_gb(r['index_bytes_model'])} | {_gb(r['baseline_rss'])} | "
            f"{_gb(r['peak_rss'])} | {r['load1_before']:.1f} |")
    lines += ["", f"## `ance-train plan` model: fitted at {fit:,} docs, checked at the others",
              "", "Predicted / measured seconds (1.00 = exact; the fit size is in-sample). "
              "*Normalised*: divided by the same ratio of flat search at that size, which "
              "cancels a change of the machine's speed (load) between the sizes.", "",
              "| docs | type | build | search | mine | build (normalised) | "
              "search (normalised) |", "|---:|---|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        ratio, norm = r["predicted_vs_measured"], r["normalised"]
        lines.append(f"| {r['size']:,} | {r['type']} | {ratio['build_s']:.2f} | "
                     f"{ratio['search_s']:.2f} | {ratio['mine_s']:.2f} | "
                     f"{norm['build_s']:.2f} | {norm['search_s']:.2f} |")
    lines += ["", "Rates at each size (ops/s; `mine`: query × candidate cells/s):", "",
              "| rate | " + " | ".join(f"{int(s):,} docs" for s in report["rates_by_size"])
              + " |", "|---|" + "---:|" * len(report["rates_by_size"])]
    for key in sorted(report["fit"]["rates"]):
        lines.append(f"| `{key}` | " + " | ".join(
            f"{rates[key]:.3g}" if key in rates else "—"
            for rates in report["rates_by_size"].values()) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    labels = [f"{r['type']}\n{r['size'] // 1000}k" for r in rows]
    x = np.arange(len(rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottom = np.zeros(len(rows))
    for key, colour in (("build_s", "#4c72b0"), ("search_s", "#dd8452"), ("mine_s", "#55a868")):
        values = np.array([r[key] for r in rows])
        left.bar(x, values, bottom=bottom, label=key.removesuffix("_s"), color=colour)
        bottom += values
    left.set_xticks(x, labels)
    left.set_ylabel("seconds per refresh")
    left.set_title(f"{report['params']['queries']} training queries, top-201")
    left.legend()
    width = 0.4
    right.bar(x - width / 2, [r["recall@10"] for r in rows], width, label="recall@10")
    right.bar(x + width / 2, [r["recall@100"] for r in rows], width, label="recall@100")
    right.set_xticks(x, labels)
    right.set_ylim(0, 1.05)
    right.set_title("recall against flat")
    right.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
