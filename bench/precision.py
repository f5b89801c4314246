"""What the lossy encoding precisions (bf16, int8) change in retrieval, against fp32.

The same model (all-MiniLM-L6-v2, cosine) encodes a SciFact sub-corpus (every positive of
the dev queries plus a seeded random sample of the other documents, ``--docs`` in all, at
``--max-length`` tokens) and the dev and train queries at each precision; exact search
gives each query its top 100. Reported per precision: cosine of the document embeddings to
fp32, overlap of the top 10 / top 100 with fp32's (for dev queries and for the training
queries, whose top-K is what becomes hard negatives), dev nDCG@10 / R@100, and encoding
docs/s (one pass each: a rough figure; bench/encode.py measures throughput properly).

    python bench/precision.py --docs 800

Writes ``precision.json`` / ``precision.md`` into ``--out``. The dev split is the project's
held-out part of train (``data.split_seed``); the test split is not used.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ance_train.config import DataConfig, ModelConfig
from ance_train.data.corpus import open_corpus
from ance_train.data.validation import validate_dataset
from ance_train.evaluation import evaluate
from ance_train.modeling.encoding import encode_texts, prepare_model
from ance_train.modeling.model import BiEncoder, load_tokenizer

from ance_train_dev.report import (
    DEFAULT_MODEL,
    command_line,
    machine,
    model_directory,
    utc_now,
    write_report,
)

REPO = Path(__file__).resolve().parents[1]
PRECISIONS = ["fp32", "bf16", "int8"]
DEPTH = 100


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, type=model_directory)
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared/data/scifact")
    parser.add_argument("--docs", type=int, default=800, help="size of the sub-corpus")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--query-length", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-tokens-per-batch", type=int, default=4096)
    parser.add_argument("--precisions", nargs="+", default=PRECISIONS, choices=PRECISIONS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: robust on a shared, oversubscribed machine)")
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks")
    return parser.parse_args(argv)


def top_k(queries: np.ndarray, docs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    scores = queries @ docs.T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(scores, order, axis=1)


def overlap(a: np.ndarray, b: np.ndarray, k: int) -> float:
    """Mean over rows of |top-k of a ∩ top-k of b| / k."""
    return float(np.mean([len(set(x[:k]) & set(y[:k])) / k for x, y in zip(a, b, strict=True)]))


def render(report: dict) -> str:
    p, m = report["params"], report["machine"]
    lines = [
        "# Encoding precision vs fp32: retrieval on SciFact", "",
        f"Command: `{report['command']}`", "",
        f"Machine: {m['cpu']} — {m['cores']} cores, torch {m['torch']}; {report['date']}; "
        f"load average before {m['load_average_before'][0]:.2f}, after "
        f"{m['load_average_after'][0]:.2f}", "",
        f"Sub-corpus: {p['docs']} docs ({p['dev_positive_docs']} dev positives + random "
        f"others), {p['dev_queries']} dev / {p['train_queries']} train queries, "
        f"max_length {p['max_length']} (queries {p['query_length']}), cosine, exact top-"
        f"{DEPTH}.", "",
        "| precision | docs/s (1 pass) | min / mean doc cosine to fp32 | dev top-10 overlap "
        "| dev top-100 overlap | train top-100 overlap | dev nDCG@10 | dev R@100 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["results"].items():
        lines.append(
            f"| {name} | {r['docs_per_s']:.2f} | {r['min_cosine']:.5f} / {r['mean_cosine']:.5f} "
            f"| {r['dev_overlap@10']:.3f} | {r['dev_overlap@100']:.3f} "
            f"| {r['train_overlap@100']:.3f} | {r['ndcg@10']:.4f} | {r['recall@100']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    data_cfg = DataConfig(path=str(args.data))
    with tempfile.TemporaryDirectory() as cache:
        dataset = validate_dataset(data_cfg, cache, seed=data_cfg.split_seed)
        corpus = open_corpus(data_cfg, cache)
        positives = sorted({d for q in dataset.dev for d in dataset.positives(q, "dev")})
        others = np.setdiff1d(np.arange(dataset.num_docs), positives)
        rng = np.random.default_rng(args.seed)
        extra = rng.choice(others, size=max(args.docs - len(positives), 0), replace=False)
        doc_rows = np.sort(np.concatenate([positives, extra]).astype(np.int64))
        doc_texts = corpus.texts(doc_rows.tolist())
    dev_ids, train_ids = sorted(dataset.dev), sorted(dataset.train)
    tokenizer = load_tokenizer(args.model)
    fp32 = BiEncoder.from_pretrained(args.model, ModelConfig(path=args.model,
                                                             similarity="cosine")).eval()
    cap = args.max_tokens_per_batch or None
    load_before = os.getloadavg()
    runs: dict[str, dict] = {}
    for precision in args.precisions:
        model = prepare_model(fp32, precision)
        started = time.perf_counter()
        docs = encode_texts(model, tokenizer, doc_texts, args.max_length, args.batch_size,
                            max_tokens_per_batch=cap)
        seconds = time.perf_counter() - started
        queries = {split: encode_texts(model, tokenizer, [dataset.queries[q] for q in ids],
                                       args.query_length, args.batch_size)
                   for split, ids in (("dev", dev_ids), ("train", train_ids))}
        runs[precision] = {"docs": docs, "seconds": seconds,
                           **{split: top_k(q, docs, DEPTH) for split, q in queries.items()}}
        print(f"{precision}: {len(doc_texts) / seconds:.2f} docs/s", file=sys.stderr)
    reference = runs["fp32"] if "fp32" in runs else next(iter(runs.values()))
    results = {}
    for precision, r in runs.items():
        ranked, scores = r["dev"]
        run = {q: {str(doc_rows[i]): float(s) for i, s in zip(row, srow, strict=True)}
               for q, row, srow in zip(dev_ids, ranked, scores, strict=True)}
        qrels = {q: {str(d): rel for d, rel in dataset.dev[q].items()} for q in dev_ids}
        metrics = evaluate(run, qrels)
        cos = (r["docs"] * reference["docs"]).sum(1) / (
            np.linalg.norm(r["docs"], axis=1) * np.linalg.norm(reference["docs"], axis=1))
        results[precision] = {
            "docs_per_s": len(doc_texts) / r["seconds"],
            "min_cosine": float(cos.min()), "mean_cosine": float(cos.mean()),
            "dev_overlap@10": overlap(ranked, reference["dev"][0], 10),
            "dev_overlap@100": overlap(ranked, reference["dev"][0], DEPTH),
            "train_overlap@100": overlap(r["train"][0], reference["train"][0], DEPTH),
            "ndcg@10": metrics["ndcg@10"], "recall@100": metrics["recall@100"],
        }
    report = {
        "command": command_line(), "date": utc_now(),
        "machine": {**machine("cpu"), "load_average_before": load_before,
                    "load_average_after": os.getloadavg()},
        "params": {"model": args.model, "docs": len(doc_rows),
                   "dev_positive_docs": len(positives), "dev_queries": len(dev_ids),
                   "train_queries": len(train_ids), "max_length": args.max_length,
                   "query_length": args.query_length, "batch_size": args.batch_size,
                   "max_tokens_per_batch": cap, "seed": args.seed},
        "results": results,
    }
    write_report(args.out, "precision", report, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
