"""Encoding throughput on SciFact: a plain Hugging Face loop vs ``encode_texts``.

(a) baseline: ``AutoModel`` + tokenizer called per batch with ``padding="max_length"``,
    ``torch.no_grad()``, mean pooling, batches in file order;
(b) ours: ``ance_train.common.encoding.encode_texts`` (tokenise once, length-sorted
    batches, dynamic padding, inference mode) with the same model, max length and batch size;
(c) optional, with ``--max-tokens-per-batch``: (b) with a cap on padded tokens per batch.

Both see the same documents in the same process; with ``--repeats`` the variants alternate
so they share the machine's noise. Tokenisation is inside the timed region for both.
The embeddings must agree (cosine > 0.999 per document): padding must not change a
mean-pooled embedding. Writes ``encode.json`` and ``encode.md`` into ``--out``.

    python bench/encode.py                      # 500 docs, 256 tokens, batch 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel

from ance_train.common.config import ModelConfig, default_model_path
from ance_train.common.encoding import encode_texts, plan_batches
from ance_train.common.model import BiEncoder, load_tokenizer

from report import command_line, machine, utc_now

REPO = Path(__file__).resolve().parents[1]
MIN_COSINE = 0.999


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=default_model_path(), help="HF model directory")
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared/data/scifact",
                        help="BEIR dataset directory holding corpus.jsonl")
    parser.add_argument("--docs", type=int, default=500, help="first N documents of the corpus")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch.set_num_threads (default: all usable cores)")
    parser.add_argument("--max-tokens-per-batch", type=int, default=None,
                        help="also measure (c): ours with this cap on padded tokens per batch")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="autocast dtype for ours (the baseline always runs float32)")
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks")
    return parser.parse_args(argv)


def load_texts(data: Path, limit: int) -> list[str]:
    texts = []
    with (data / "corpus.jsonl").open(encoding="utf-8") as lines:
        for line in lines:
            if len(texts) >= limit:
                break
            doc = json.loads(line)
            texts.append(f"{doc.get('title', '')} {doc.get('text', '')}")
    return texts


def baseline_encode(model, tokenizer, texts, max_length, batch_size, device) -> np.ndarray:
    """The textbook Hugging Face loop: pad every batch to max_length, in file order."""
    rows = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start:start + batch_size], padding="max_length",
                              truncation=True, max_length=max_length, return_tensors="pt")
            batch = {k: v.to(device) for k, v in batch.items()}
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
            rows.append(pooled.float().cpu().numpy())
    return np.concatenate(rows)


def agreement(reference: np.ndarray, other: np.ndarray) -> dict:
    cos = (reference * other).sum(1) / (
        np.linalg.norm(reference, axis=1) * np.linalg.norm(other, axis=1)
    )
    return {
        "min_cosine": float(cos.min()),
        "max_abs_diff": float(np.abs(reference - other).max()),
        "ok": bool(cos.min() > MIN_COSINE),
    }


def padded_tokens(lengths: list[int], batch_size: int) -> int:
    """Tokens ``encode_texts`` feeds the model: each length-sorted batch padded to its longest."""
    return sum(lengths[batch[0]] * len(batch) for batch in plan_batches(lengths, batch_size))


def timed(fn: Callable[[], np.ndarray]) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _loads(loads) -> str:
    return " / ".join(f"{x:.2f}" for x in loads)


def render_markdown(report: dict) -> str:
    p, m = report["params"], report["machine"]
    lines = [
        "# Encoding throughput (SciFact)",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {m['cpu']} — {m['cores']} cores, {p['threads']} torch threads, "
        f"device {m['device']}, torch {m['torch']}, transformers {m['transformers']}, "
        f"{m['platform']}; {report['date']}",
        "",
        f"Params: {p['docs']} docs (mean {p['mean_tokens']:.0f} tokens after truncation, "
        f"{p['share_truncated']:.0%} at the cap), max_length {p['max_length']}, "
        f"batch size {p['batch_size']}, repeats {p['repeats']}, model `{p['model']}`",
        "",
        f"Load average (1/5/15 min) before: {_loads(m['load_average_before'])}, "
        f"after: {_loads(m['load_average_after'])}",
        "",
        "| variant | docs/s (median) | docs/s (best) | ratio vs baseline | min cosine "
        "| max abs diff |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["results"].items():
        agree = report["agreement"].get(name)
        cos = f"{agree['min_cosine']:.6f}" if agree else "—"
        diff = f"{agree['max_abs_diff']:.2e}" if agree else "—"
        lines.append(f"| {name} | {r['docs_per_s']:.1f} | {r['docs_per_s_best']:.1f} | "
                     f"{r['ratio_vs_baseline']:.2f} | {cos} | {diff} |")
    lines += ["", f"Padded tokens per run: baseline {p['baseline_tokens']}, "
              f"ours {p['ours_tokens']} ({p['ours_tokens'] / p['baseline_tokens']:.1%})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    texts = load_texts(args.data, args.docs)
    tokenizer = load_tokenizer(args.model)
    baseline_model = AutoModel.from_pretrained(args.model, local_files_only=True).to(device)
    baseline_model.eval()
    ours_model = BiEncoder.from_pretrained(args.model, ModelConfig(path=args.model)).to(device)
    dtype = getattr(torch, args.dtype)

    lengths = [len(ids) for ids in tokenizer(texts, truncation=True,
                                              max_length=args.max_length)["input_ids"]]
    variants: dict[str, Callable[[], np.ndarray]] = {
        "baseline": lambda: baseline_encode(baseline_model, tokenizer, texts, args.max_length,
                                            args.batch_size, device),
        "ours": lambda: encode_texts(ours_model, tokenizer, texts, args.max_length,
                                     args.batch_size, device, dtype=dtype),
    }
    if args.max_tokens_per_batch:
        variants[f"ours, max_tokens_per_batch={args.max_tokens_per_batch}"] = (
            lambda: encode_texts(ours_model, tokenizer, texts, args.max_length, args.batch_size,
                                 device, max_tokens_per_batch=args.max_tokens_per_batch,
                                 dtype=dtype)
        )

    load_before = os.getloadavg()  # other processes on the machine skew the timings
    # Warm-up (allocator, thread pool, kernels) on a few documents, untimed.
    warm = texts[: args.batch_size]
    baseline_encode(baseline_model, tokenizer, warm, args.max_length, args.batch_size, device)
    encode_texts(ours_model, tokenizer, warm, args.max_length, args.batch_size, device,
                 dtype=dtype)

    seconds: dict[str, list[float]] = {name: [] for name in variants}
    outputs: dict[str, np.ndarray] = {}
    for repeat in range(args.repeats):
        for name, fn in variants.items():
            elapsed, outputs[name] = timed(fn)
            seconds[name].append(elapsed)
            print(f"repeat {repeat + 1}/{args.repeats} {name}: {elapsed:.2f}s "
                  f"({len(texts) / elapsed:.1f} docs/s)", file=sys.stderr)

    base_rate = len(texts) / statistics.median(seconds["baseline"])
    results = {}
    for name, times in seconds.items():
        rate = len(texts) / statistics.median(times)
        results[name] = {"docs_per_s": rate, "docs_per_s_best": len(texts) / min(times),
                         "seconds_median": statistics.median(times), "seconds": times,
                         "ratio_vs_baseline": rate / base_rate}
    agree = {name: agreement(outputs["baseline"], out)
             for name, out in outputs.items() if name != "baseline"}

    report = {
        "command": command_line(),
        "date": utc_now(),
        "machine": {**machine(str(device)), "load_average_before": load_before,
                    "load_average_after": os.getloadavg()},
        "params": {"model": args.model, "data": str(args.data), "docs": len(texts),
                   "max_length": args.max_length, "batch_size": args.batch_size,
                   "repeats": args.repeats, "threads": args.threads,
                   "max_tokens_per_batch": args.max_tokens_per_batch, "dtype": args.dtype,
                   "mean_tokens": float(np.mean(lengths)),
                   "share_truncated": float(np.mean(np.array(lengths) >= args.max_length)),
                   "baseline_tokens": len(texts) * args.max_length,
                   "ours_tokens": padded_tokens(lengths, args.batch_size)},
        "results": results,
        "agreement": agree,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "encode.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = render_markdown(report)
    (args.out / "encode.md").write_text(markdown)
    print(markdown)
    if not all(a["ok"] for a in agree.values()):
        print(f"embeddings disagree (min cosine <= {MIN_COSINE})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
