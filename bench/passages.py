"""What MaxP costs against FirstP: encode time, index memory, store size and search latency.

MaxP (``data.passages.mode: max``; ANCE, arXiv:2007.00808 §5) encodes every passage of a
document, so the corpus grows from D documents to N passages. This measures each cost on the
same documents with the code the services run, three settings side by side:

* ``firstp-<L>``: each document's first L tokens (today's default, ``model.max_doc_length``);
* ``maxp-<L>``: passages of L tokens, at most ``--max-passages`` per document
  (:class:`~ance_train.modeling.passages.PassageSplitter`, as the inferencer cuts them);
* ``firstp-<2L>``: the first 2L tokens, the reference that sees as much text per vector.

Encode: the inferencer's path (cut into passages, tokenise, :func:`encode_ids`), repeated
``--repeats`` times with the settings interleaved (the median is reported, and ratios to
``firstp-<L>`` of the same repetition), so a busy machine slows every setting alike. Store:
the bytes of the corpus shards as :func:`pack_embeddings` writes them (float16 plus the
passage numbers). Index: the flat ``AnnIndex`` the indexer builds (FAISS's serialised size)
plus its row map (8 bytes a row). Search: top-10 and top-100 for the dataset's test queries
through ``AnnIndex.search`` (FirstP) or :class:`~ance_train.index.passages.PassageIndex`
(MaxP: k × max_passages passages collapsed to documents), median over repetitions.

    python bench/passages.py --docs 1000

Writes ``passages-cost.json`` / ``passages-cost.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ance_train.config import DataConfig, IndexConfig, ModelConfig, PassagesConfig
from ance_train.data.corpus import open_corpus
from ance_train.data.validation import validate_dataset
from ance_train.index.ann import AnnIndex
from ance_train.index.passages import PassageIndex
from ance_train.modeling.encoding import (
    encode_ids,
    encode_texts,
    pad_token_id,
    prepare_model,
    resolve_precision,
    tokenize_texts,
)
from ance_train.modeling.model import BiEncoder, load_tokenizer
from ance_train.modeling.passages import PassageSplitter
from ance_train.protocol.embeddings import pack_embeddings, passage_keys

from ance_train_dev.report import command_line, machine, model_directory, utc_now, write_report

REPO = Path(__file__).resolve().parents[1]
SHARD = 500  # documents per corpus shard (the quality profiles' inference.shard_size)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared/data/scifact")
    parser.add_argument("--docs", type=int, default=1000,
                        help="the first N documents of the corpus (0: all)")
    parser.add_argument("--model", type=model_directory, default="minilm")
    parser.add_argument("--length", type=int, default=128, help="L, tokens per passage")
    parser.add_argument("--max-passages", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks")
    return parser.parse_args(argv)


def model_label(path: str) -> str:
    """The packaged MiniLM by name; any other model by its directory."""
    from ance_train.config import default_model_path

    return "all-MiniLM-L6-v2 (the packaged model)" if path == str(default_model_path()) else path


def encode_setting(model: BiEncoder, tokenizer, texts: list[str], length: int,
                   splitter: PassageSplitter | None, batch_size: int
                   ) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
    """Seconds to cut, tokenise and encode ``texts``, and the rows: (documents, passage
    numbers, vectors)."""
    started = time.perf_counter()
    if splitter is None:
        rows, documents, passages = texts, np.arange(len(texts)), np.zeros(len(texts), np.int64)
    else:
        split = splitter.split(texts)
        rows, documents, passages = split.texts, split.documents, split.passages
    ids = tokenize_texts(tokenizer, rows, length, model.prompt("document"))
    vectors = encode_ids(model, ids, pad_token_id(tokenizer), batch_size=batch_size,
                         device="cpu", max_tokens_per_batch=4096)
    return time.perf_counter() - started, documents, np.asarray(passages), vectors


def store_bytes(documents: np.ndarray, passages: np.ndarray, vectors: np.ndarray,
                maxp: bool) -> int:
    """Bytes of the corpus shards (float16, ``SHARD`` documents each) as stored."""
    total = 0
    for start in range(0, int(documents.max()) + 1, SHARD):
        rows = (documents >= start) & (documents < start + SHARD)
        total += len(pack_embeddings(documents[rows], vectors[rows], "float16",
                                     passages[rows] if maxp else None))
    return total


def search_ms(index, queries: np.ndarray, k: int, repeats: int) -> float:
    """Median milliseconds per query of a top-``k`` search of all ``queries``."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        index.search(queries, k)
        times.append((time.perf_counter() - started) * 1000 / len(queries))
    return statistics.median(times)


def render(report: dict) -> str:
    m, p = report["machine"], report["params"]
    base = report["settings"][0]["name"]
    lines = [
        "# What MaxP costs against FirstP (`data.passages`)", "",
        f"Command: `{report['command']}`", "",
        f"Machine: {m['cpu']} ({', '.join(m['cpu_flags'])}) — {m['cores']} cores, torch "
        f"{m['torch']}; {report['date']}.", "",
        f"SciFact, the first {p['docs']} documents; model `{p['model']}`; "
        f"{p['queries']} test queries searched; encode times are medians of {p['repeats']} "
        f"interleaved repetitions on {p['threads']} threads, in "
        f"{report['precision']}. Ratios are to `{base}` (same repetition for encode time).",
        "",
        "| setting | vectors | passages / doc | encode s | × | store bytes / refresh | × "
        "| index bytes | × | search top-10 ms/query | × | top-100 ms/query | × |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in report["settings"]:
        lines.append(
            f"| {s['name']} | {s['vectors']:,} | {s['passages_per_doc']:.2f} | "
            f"{s['encode_s']:.1f} | {s['encode_ratio']:.2f} | {s['store_bytes']:,} | "
            f"{s['store_ratio']:.2f} | {s['index_bytes']:,} | {s['index_ratio']:.2f} | "
            f"{s['search10_ms']:.3f} | {s['search10_ratio']:.2f} | {s['search100_ms']:.3f} | "
            f"{s['search100_ratio']:.2f} |")
    hist = report["passage_histogram"]
    lines += ["", "Passages per document with MaxP: "
              + ", ".join(f"{n}: {c}" for n, c in hist.items()) + ".", "",
              report["conclusion"], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    data_cfg = DataConfig(path=str(args.data))
    with tempfile.TemporaryDirectory() as cache:
        dataset = validate_dataset(data_cfg, cache, seed=data_cfg.split_seed)
        corpus = open_corpus(data_cfg, cache)
        count = dataset.num_docs if not args.docs else min(args.docs, dataset.num_docs)
        texts = corpus.texts(list(range(count)))
    model_cfg = ModelConfig(path=args.model, max_doc_length=args.length)
    tokenizer = load_tokenizer(model_cfg.path)
    # The precision an inferencer picks here (inference.precision auto: bf16 where native).
    precision = resolve_precision("auto", "cpu")
    model = prepare_model(BiEncoder.from_pretrained(model_cfg.path, model_cfg).eval(),
                          precision)  # type: ignore[arg-type]
    query_texts = [dataset.queries[q] for q in sorted(dataset.test)]
    queries = encode_texts(model, tokenizer, query_texts, max_length=64, kind="query",
                           batch_size=args.batch_size, device="cpu")
    passages_cfg = PassagesConfig(mode="max", max_passages=args.max_passages)
    splitter = PassageSplitter(tokenizer, passages_cfg, args.length, model.prompt("document"))
    settings = [(f"firstp-{args.length}", args.length, None),
                (f"maxp-{args.length}", args.length, splitter),
                (f"firstp-{2 * args.length}", 2 * args.length, None)]
    times: dict[str, list[float]] = {name: [] for name, _, _ in settings}
    encoded = {}
    for _ in range(args.repeats):
        for name, length, cut in settings:
            seconds, documents, passages, vectors = encode_setting(
                model, tokenizer, texts, length, cut, args.batch_size)
            times[name].append(seconds)
            encoded[name] = (documents, passages, vectors)
    rows = []
    for name, _, cut in settings:
        documents, passages, vectors = encoded[name]
        maxp = cut is not None
        keys = passage_keys(documents, passages, args.max_passages) if maxp else documents
        flat = AnnIndex(vectors.shape[1], IndexConfig(type="flat", device="cpu"))
        flat.add(keys, vectors)
        flat.finalize()
        index = PassageIndex(flat, args.max_passages, count) if maxp else flat
        ratios = [t / b for t, b in zip(times[name], times[settings[0][0]], strict=True)]
        rows.append({
            "name": name, "vectors": len(vectors), "passages_per_doc": len(vectors) / count,
            "encode_s": statistics.median(times[name]), "encode_s_all": times[name],
            "encode_ratio": statistics.median(ratios),
            "store_bytes": store_bytes(documents, passages, vectors, maxp),
            "index_bytes": flat.nbytes() + 8 * len(vectors),
            "search10_ms": search_ms(index, queries, 10, args.repeats * 3),
            "search100_ms": search_ms(index, queries, 100, args.repeats * 3)})
    for row in rows:
        for key, ratio in (("store_bytes", "store_ratio"), ("index_bytes", "index_ratio"),
                           ("search10_ms", "search10_ratio"),
                           ("search100_ms", "search100_ratio")):
            row[ratio] = row[key] / rows[0][key]
    counts = np.bincount(encoded[settings[1][0]][0], minlength=count)
    histogram = {int(n): int(c) for n, c in zip(*np.unique(counts, return_counts=True),
                                                 strict=True)}
    maxp_row = rows[1]
    conclusion = (
        f"MaxP over {args.length}-token passages holds {maxp_row['passages_per_doc']:.2f} "
        f"vectors per document here: encoding costs {maxp_row['encode_ratio']:.2f}× FirstP "
        f"at {args.length}, the store {maxp_row['store_ratio']:.2f}× and the flat index "
        f"{maxp_row['index_ratio']:.2f}× (both linear in vectors); a top-10 search costs "
        f"{maxp_row['search10_ratio']:.2f}× (it asks the index for 10 × {args.max_passages} "
        f"passages and collapses them). FirstP at {2 * args.length} costs "
        f"{rows[2]['encode_ratio']:.2f}× to encode with one vector per document.")
    report = {"command": command_line(), "machine": machine(), "date": utc_now(),
              "precision": precision,
              "params": {"docs": count, "model": model_label(str(args.model)),
                         "length": args.length,
                         "max_passages": args.max_passages, "repeats": args.repeats,
                         "threads": args.threads, "queries": len(queries),
                         "shard_documents": SHARD},
              "settings": rows, "passage_histogram": histogram, "conclusion": conclusion}
    write_report(args.out, "passages-cost", report, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
