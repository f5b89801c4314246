"""What storing embedding shards as float16 instead of float32 changes in retrieval.

``inference.embedding_dtype`` only changes what :func:`ance_train.protocol.embeddings.
pack_embeddings` writes: the inferencer encodes exactly as before (float32 out of the model)
and the shard stores ``vectors.astype(float16)``; the indexer reads it back with
:func:`unpack_embeddings`, which upcasts to float32 for FAISS. So one float32 encoding,
passed through ``pack_embeddings(..., "float16")`` and ``unpack_embeddings`` — the very code
the services run — is the float16 run; nothing needs encoding twice.

The zero-shot model of the default configuration (``ModelConfig()``: all-MiniLM-L6-v2,
mean pooling, the default similarity and lengths) encodes the whole SciFact corpus and every
query once; the indexer's own ``AnnIndex`` (exact inner product, ``IndexConfig()``) gives
each query its top 100 from the float32 and the float16 shards. Reported per split (train:
the hard-negative candidates; dev; test): top-100 overlap per query (mean, min), top-10
overlap, nDCG@10 / R@100 of both and their difference with a paired sign-flip test and a
95 % bootstrap interval over queries, and the shard bytes of each dtype.

    python bench/embedding_dtype.py

Writes ``embedding-dtype.json`` / ``embedding-dtype.md`` into ``--out``.
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

from ance_train.config import DataConfig, IndexConfig, ModelConfig
from ance_train.data.corpus import open_corpus
from ance_train.data.validation import validate_dataset
from ance_train.evaluation import evaluate, evaluate_per_query
from ance_train.index.ann import AnnIndex
from ance_train.modeling.encoding import encode_texts
from ance_train.modeling.model import BiEncoder, load_tokenizer
from ance_train.protocol.embeddings import pack_embeddings, unpack_embeddings

from ance_train_dev.report import command_line, machine, utc_now, write_report

REPO = Path(__file__).resolve().parents[1]
DEPTH = 100
SPLITS = ("train", "dev", "test")
RESAMPLES = 10_000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared/data/scifact")
    parser.add_argument("--docs", type=int, default=None,
                        help="encode only the first N documents (default: the whole corpus)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-tokens-per-batch", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="resampling seed")
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks")
    return parser.parse_args(argv)


def through_shard(ids: np.ndarray, vectors: np.ndarray, dtype: str) -> tuple[np.ndarray, int]:
    """The vectors as the indexer reads them from a ``dtype`` shard, and the shard's bytes."""
    data = pack_embeddings(ids, vectors, dtype)  # type: ignore[arg-type]
    _, read = unpack_embeddings(data)
    return read, len(data)


def paired(a: np.ndarray, b: np.ndarray, rng: np.random.Generator) -> dict:
    """Mean of b − a, its 95 % bootstrap interval and a two-sided sign-flip p-value."""
    diff = b - a
    n = len(diff)
    boot = diff[rng.integers(0, n, size=(RESAMPLES, n))].mean(1)
    flips = rng.choice([-1.0, 1.0], size=(RESAMPLES, n))
    null = np.abs((flips * diff).mean(1))
    observed = abs(diff.mean())
    p = float((np.sum(null >= observed - 1e-15) + 1) / (RESAMPLES + 1))
    return {"mean_diff": float(diff.mean()), "ci95": [float(np.percentile(boot, 2.5)),
                                                       float(np.percentile(boot, 97.5))],
            "p_value": p, "queries_changed": int(np.sum(np.abs(diff) > 1e-12)),
            "queries": n}


def overlaps(a: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    return np.array([len(set(x[:k]) & set(y[:k])) / k for x, y in zip(a, b, strict=True)])


def render(report: dict) -> str:
    p, m = report["params"], report["machine"]
    size = report["shard_bytes"]
    lines = [
        "# Embedding shards in float16 vs float32 (`inference.embedding_dtype`)", "",
        f"Command: `{report['command']}`", "",
        f"Machine: {m['cpu']} — {m['cores']} cores, torch {m['torch']}; {report['date']}; "
        f"encoding {report['encode_s']:.0f} s (once, float32).", "",
        f"Model: `{p['model']}` (the default `ModelConfig()`: pooling {p['pooling']}, "
        f"similarity {p['similarity']}, max length {p['max_doc_length']} / "
        f"{p['max_query_length']}); SciFact, {p['docs']} documents, dim {p['dim']}; exact "
        f"inner-product top-{DEPTH} with the indexer's `AnnIndex`. The float16 run is the "
        "float32 encoding written by `pack_embeddings(..., \"float16\")` and read back by "
        "`unpack_embeddings` (upcast to float32), exactly what the inferencer and the indexer "
        "do, so both runs share one encoding.", "",
        f"Shard bytes (corpus, one `.npz`): float32 {size['float32']:,}, float16 "
        f"{size['float16']:,} ({size['float16'] / size['float32']:.3f}×). Largest absolute "
        f"change of a vector component: {report['max_abs_error']:.2e}; smallest cosine "
        f"between a document's float32 and float16 vector: {report['min_doc_cosine']:.7f}.", "",
        "| split | queries | top-100 overlap mean | min | top-10 overlap mean | min "
        "| nDCG@10 fp32 → fp16 | Δ nDCG@10 [95 % CI], p | R@100 fp32 → fp16 | Δ R@100 "
        "| queries whose nDCG@10 changed |",
        "|---|---:|---:|---:|---:|---:|---|---|---|---:|---:|",
    ]
    for split, r in report["splits"].items():
        nd, rc = r["ndcg@10"], r["recall@100"]
        lines.append(
            f"| {split} | {r['queries']} | {r['overlap@100_mean']:.4f} | "
            f"{r['overlap@100_min']:.2f} | {r['overlap@10_mean']:.4f} | "
            f"{r['overlap@10_min']:.1f} | {nd['float32']:.4f} → {nd['float16']:.4f} | "
            f"{nd['mean_diff']:+.5f} [{nd['ci95'][0]:+.5f}, {nd['ci95'][1]:+.5f}], "
            f"p = {nd['p_value']:.2f} | {rc['float32']:.4f} → {rc['float16']:.4f} | "
            f"{rc['mean_diff']:+.5f} | {nd['queries_changed']} |")
    lines += ["", report["conclusion"], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    data_cfg = DataConfig(path=str(args.data))
    model_cfg = ModelConfig()
    with tempfile.TemporaryDirectory() as cache:
        dataset = validate_dataset(data_cfg, cache, seed=data_cfg.split_seed)
        corpus = open_corpus(data_cfg, cache)
        rows = np.arange(dataset.num_docs if args.docs is None else args.docs, dtype=np.int64)
        doc_texts = corpus.texts(rows.tolist())
    tokenizer = load_tokenizer(model_cfg.path)
    model = BiEncoder.from_pretrained(model_cfg.path, model_cfg).eval()
    cap = args.max_tokens_per_batch or None
    started = time.perf_counter()
    docs = encode_texts(model, tokenizer, doc_texts, model_cfg.max_doc_length, args.batch_size,
                        max_tokens_per_batch=cap, dtype=torch.float32)
    split_ids = {split: sorted(getattr(dataset, split)) for split in SPLITS}
    queries = {split: encode_texts(model, tokenizer, [dataset.queries[q] for q in ids],
                                   model_cfg.max_query_length, args.batch_size,
                                   dtype=torch.float32)
               for split, ids in split_ids.items() if ids}
    encode_s = time.perf_counter() - started
    print(f"encoded {len(doc_texts)} docs + queries in {encode_s:.0f}s", file=sys.stderr)

    rng = np.random.default_rng(args.seed)
    shard_bytes, ranked = {}, {}
    read_back = {}
    for dtype in ("float32", "float16"):
        docs_read, shard_bytes[dtype] = through_shard(rows, docs, dtype)
        read_back[dtype] = docs_read
        index = AnnIndex(docs.shape[1], IndexConfig(), expected_size=len(rows))
        index.add(rows, docs_read)
        index.finalize()
        ranked[dtype] = {}
        for split, q in queries.items():
            q_read, _ = through_shard(np.array(split_ids[split]), q, dtype)
            ranked[dtype][split] = index.search(q_read, DEPTH)
    a, b = read_back["float32"], read_back["float16"]
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    splits = {}
    for split in queries:
        ids = split_ids[split]
        qrels = {q: {str(d): rel for d, rel in getattr(dataset, split)[q].items()} for q in ids}
        per_dtype = {}
        for dtype in ("float32", "float16"):
            docs_ranked, scores = ranked[dtype][split]
            run = {q: {str(d): float(s) for d, s in zip(r, sc, strict=True) if d >= 0}
                   for q, r, sc in zip(ids, docs_ranked, scores, strict=True)}
            per_dtype[dtype] = {"mean": evaluate(run, qrels)}
            for measure in ("ndcg@10", "recall@100"):
                per_query = evaluate_per_query(run, qrels, measure)
                per_dtype[dtype][measure] = np.array([per_query[q] for q in ids])
        o100 = overlaps(ranked["float32"][split][0], ranked["float16"][split][0], DEPTH)
        o10 = overlaps(ranked["float32"][split][0], ranked["float16"][split][0], 10)
        splits[split] = {
            "queries": len(ids),
            "overlap@100_mean": float(o100.mean()), "overlap@100_min": float(o100.min()),
            "overlap@10_mean": float(o10.mean()), "overlap@10_min": float(o10.min()),
            **{measure: {"float32": per_dtype["float32"]["mean"][measure],
                         "float16": per_dtype["float16"]["mean"][measure],
                         **paired(per_dtype["float32"][measure], per_dtype["float16"][measure],
                                  rng)}
               for measure in ("ndcg@10", "recall@100")}}
    noise = all(max(abs(v) for v in r[m]["ci95"]) < 0.005 and r[m]["p_value"] > 0.05
                for r in splits.values() for m in ("ndcg@10", "recall@100"))
    conclusion = (
        "No metric changes beyond noise (every difference's 95 % interval within ±0.005 and "
        "p > 0.05): `inference.embedding_dtype` defaults to float16."
        if noise else
        "At least one metric changes beyond noise: `inference.embedding_dtype` stays float32 "
        "by default.")
    report = {
        "command": command_line(), "date": utc_now(),
        "machine": {**machine("cpu"), "load_average": os.getloadavg()},
        "params": {"model": model_cfg.path, "pooling": model_cfg.pooling,
                   "similarity": model_cfg.similarity, "max_doc_length": model_cfg.max_doc_length,
                   "max_query_length": model_cfg.max_query_length, "docs": len(rows),
                   "dim": int(docs.shape[1]), "batch_size": args.batch_size,
                   "max_tokens_per_batch": cap, "seed": args.seed, "resamples": RESAMPLES},
        "encode_s": encode_s, "shard_bytes": shard_bytes,
        "max_abs_error": float(np.abs(a - b).max()), "min_doc_cosine": float(cos.min()),
        "splits": splits, "no_change_beyond_noise": noise, "conclusion": conclusion,
    }
    write_report(args.out, "embedding-dtype", report, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
