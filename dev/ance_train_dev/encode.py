"""Encoding throughput on SciFact: a plain Hugging Face loop vs ``encode_texts``.

CPU (default): every variant encodes the same documents in the same process, alternating
repetition by repetition so that they share the machine's noise (the median is reported):

- ``baseline``: ``AutoModel`` + tokenizer per batch, ``padding="max_length"``,
  ``torch.no_grad()``, mean pooling, batches in file order, fp32, transformers' default
  attention (SDPA);
- ``ours …``: ``encode_texts`` (tokenise once, length-sorted batches capped at
  ``--max-tokens-per-batch`` padded tokens, dynamic padding, inference mode) at a precision
  (``fp32`` / ``bf16`` / ``int8``, :func:`prepare_model`), optionally with tokenisation on a
  background thread (``bg``) or eager attention (``eager``, to price SDPA).

Tokenisation is inside the timed region for every variant. Every variant's embeddings are
compared with the baseline's (cosine per document); fp32 variants must agree to 0.999.

``--mode mfu`` (the default with ``--device cuda``): docs/s and model FLOP utilisation (MFU)
of a BERT-base-sized encoder (random weights: throughput does not depend on them) at 256 and
512 tokens, for SciFact documents and for full-length sequences, ours (bf16 weights + SDPA,
length-sorted) vs the padded fp32 baseline. ``--arch tiny`` runs the same code path with a
2-layer model (for checking it on a CPU). ``--mode compare`` runs the variants above on any
device (e.g. a GPU with your own ``--model``; int8 is CPU-only).

    python bench/encode.py --docs 96 --repeats 3 --threads 1   # CPU, MiniLM, 256 tokens
    python bench/encode.py --device cuda                       # GPU: BERT-base, 256 + 512
    python bench/encode.py --device cuda --mode compare --variants "ours bf16 bg"

Writes ``encode.json`` / ``encode.md`` (``encode-cuda.*`` when comparing on a GPU,
``encode-<device>-<arch>.*`` for the MFU mode) into ``--out``.
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
from transformers import AutoModel, BertConfig, BertModel

from ance_train.config import ModelConfig
from ance_train.modeling.encoding import encode_texts, plan_batches, prepare_model
from ance_train.modeling.model import BiEncoder, load_tokenizer

from ance_train_dev.report import (
    DEFAULT_MODEL,
    command_line,
    machine,
    model_directory,
    utc_now,
    write_report,
)

REPO = Path(__file__).resolve().parents[2]
MIN_COSINE = 0.999
CPU_VARIANTS = ["baseline", "ours fp32", "ours fp32 bg", "ours fp32 eager", "ours bf16",
                "ours bf16 bg", "ours int8"]
# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' data sheets, matched on the name.
GPU_PEAK_BF16 = {"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12,
                 "L40S": 362e12, "L4": 121e12, "A10": 125e12}
ARCHS = {"bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                           intermediate_size=3072),
         "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=128)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, type=model_directory,
                        help="HF model directory (default: the MiniLM package)")
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared/data/scifact",
                        help="BEIR dataset directory holding corpus.jsonl")
    parser.add_argument("--docs", type=int, default=None,
                        help="first N documents (default: 500 on CPU, the corpus on GPU)")
    parser.add_argument("--max-length", type=int, default=256, help="compare mode")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="rows per batch (default: 32 on CPU, 256 on GPU)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch.set_num_threads (default: all usable cores)")
    parser.add_argument("--max-tokens-per-batch", type=int, default=4096,
                        help="cap on padded tokens per batch for ours (compare mode; the "
                             "inferencer's CPU default); 0: no cap")
    parser.add_argument("--variants", nargs="+", default=CPU_VARIANTS, choices=CPU_VARIANTS,
                        help="compare mode: what to measure (baseline is always included)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--mode", choices=["compare", "mfu"], default=None,
                        help="default: mfu on cuda, compare on cpu")
    parser.add_argument("--arch", default="bert-base", choices=sorted(ARCHS),
                        help="mfu mode: the encoder's shape")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512], help="mfu mode")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="mfu mode: dense bf16 peak of the device (default: data sheet)")
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks")
    args = parser.parse_args(argv)
    if args.mode is None:
        args.mode = "mfu" if args.device == "cuda" or args.arch != "bert-base" else "compare"
    if args.docs is None:
        args.docs = 1_000_000 if args.mode == "mfu" else 500
    if args.batch_size is None:
        args.batch_size = 256 if args.device == "cuda" else 32
    return args


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


def agreement(reference: np.ndarray, other: np.ndarray, min_cosine: float | None) -> dict:
    cos = (reference * other).sum(1) / (
        np.linalg.norm(reference, axis=1) * np.linalg.norm(other, axis=1)
    )
    return {
        "min_cosine": float(cos.min()),
        "mean_cosine": float(cos.mean()),
        "max_abs_diff": float(np.abs(reference - other).max()),
        "ok": True if min_cosine is None else bool(cos.min() > min_cosine),
    }


def padded_tokens(lengths: list[int], batch_size: int, cap: int | None = None) -> int:
    """Tokens ``encode_texts`` feeds the model: each length-sorted batch padded to its longest."""
    return sum(lengths[batch[0]] * len(batch) for batch in plan_batches(lengths, batch_size, cap))


def timed(fn: Callable[[], np.ndarray], device: torch.device) -> tuple[float, np.ndarray]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def measure(variants: dict[str, Callable[[], np.ndarray]], repeats: int, docs: int,
            device: torch.device) -> tuple[dict, dict[str, np.ndarray]]:
    """Run every variant ``repeats`` times, alternating; docs/s from the median time."""
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    outputs: dict[str, np.ndarray] = {}
    for repeat in range(repeats):
        for name, fn in variants.items():
            elapsed, outputs[name] = timed(fn, device)
            seconds[name].append(elapsed)
            print(f"repeat {repeat + 1}/{repeats} {name}: {elapsed:.2f}s "
                  f"({docs / elapsed:.1f} docs/s) load {os.getloadavg()[0]:.2f}",
                  file=sys.stderr)
    return summarise(seconds, docs), outputs


def summarise(seconds: dict[str, list[float]], docs: int) -> dict:
    """docs/s per variant (median and best) and two ratios to the baseline: of the medians,
    and the median over repetitions of the same repetition's ratio (robust to drifting load)."""
    base = docs / statistics.median(seconds["baseline"])
    results = {}
    for name, times in seconds.items():
        rate = docs / statistics.median(times)
        paired = [b / t for b, t in zip(seconds["baseline"], times, strict=True)]
        results[name] = {"docs_per_s": rate, "docs_per_s_best": docs / min(times),
                         "seconds_median": statistics.median(times), "seconds": times,
                         "ratio_vs_baseline": rate / base,
                         "paired_ratio_vs_baseline": statistics.median(paired)}
    return results


def _loads(loads) -> str:
    return " / ".join(f"{x:.2f}" for x in loads)


def _header(report: dict, title: str) -> list[str]:
    m = report["machine"]
    return [
        f"# {title}", "",
        f"Command: `{report['command']}`", "",
        f"Machine: {m['cpu']} — {m['cores']} cores, {report['params']['threads']} torch "
        f"threads, device {m['device']}" + (f" ({m['gpu']})" if m.get("gpu") else "") +
        f", torch {m['torch']}, transformers {m['transformers']}, {m['platform']}; "
        f"{report['date']}", "",
        f"Load average (1/5/15 min) before: {_loads(m['load_average_before'])}, "
        f"after: {_loads(m['load_average_after'])}", "",
    ]


def render_compare(report: dict) -> str:
    p = report["params"]
    lines = [
        *_header(report, f"Encoding throughput (SciFact, {report['machine']['device']})"),
        f"Params: {p['docs']} docs (mean {p['mean_tokens']:.0f} tokens after truncation, "
        f"{p['share_truncated']:.0%} at the cap), max_length {p['max_length']}, "
        f"batch size {p['batch_size']}, ours capped at {p['max_tokens_per_batch']} padded "
        f"tokens per batch, repeats {p['repeats']} (alternating), model `{p['model']}`", "",
        "| variant | docs/s (median) | docs/s (best) | ratio of medians | ratio, paired by "
        "repetition (median) | min cosine | mean cosine |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["results"].items():
        agree = report["agreement"].get(name)
        cos = f"{agree['min_cosine']:.6f}" if agree else "—"
        mean = f"{agree['mean_cosine']:.6f}" if agree else "—"
        lines.append(f"| {name} | {r['docs_per_s']:.2f} | {r['docs_per_s_best']:.2f} | "
                     f"{r['ratio_vs_baseline']:.2f} | {r['paired_ratio_vs_baseline']:.2f} | "
                     f"{cos} | {mean} |")
    lines += ["", f"Padded tokens per run: baseline {p['baseline_tokens']}, "
              f"ours {p['ours_tokens']} ({p['ours_tokens'] / p['baseline_tokens']:.1%}).",
              "", "Variants: `bg` = tokenisation on a background thread; `eager` = eager "
              "attention instead of SDPA; bf16 / int8 = weights converted by "
              "`prepare_model` (lossy: see `precision.md` for their effect on retrieval)."]
    return "\n".join(lines) + "\n"


def run_compare(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    texts = load_texts(args.data, args.docs)
    tokenizer = load_tokenizer(args.model)
    cap = args.max_tokens_per_batch or None
    baseline_model = AutoModel.from_pretrained(args.model, local_files_only=True).to(device)
    baseline_model.eval()
    fp32 = BiEncoder.from_pretrained(args.model, ModelConfig(path=args.model)).to(device).eval()
    models = {"fp32": fp32}
    wanted = set(args.variants)
    if {"ours bf16", "ours bf16 bg"} & wanted:
        models["bf16"] = prepare_model(fp32, "bf16", device)
    if "ours int8" in wanted:
        models["int8"] = prepare_model(fp32, "int8", device)
    if "ours fp32 eager" in wanted:
        eager = AutoModel.from_pretrained(args.model, local_files_only=True,
                                          attn_implementation="eager")
        models["eager"] = BiEncoder(eager).to(device).eval()

    def ours(model: BiEncoder, background: bool = False) -> Callable[[], np.ndarray]:
        return lambda: encode_texts(model, tokenizer, texts, args.max_length, args.batch_size,
                                    device, max_tokens_per_batch=cap, background=background)

    candidates: dict[str, Callable[[], np.ndarray]] = {
        "baseline": lambda: baseline_encode(baseline_model, tokenizer, texts, args.max_length,
                                            args.batch_size, device),
        "ours fp32": ours(fp32), "ours fp32 bg": ours(fp32, background=True),
        "ours fp32 eager": ours(models.get("eager", fp32)),
        "ours bf16": ours(models.get("bf16", fp32)),
        "ours bf16 bg": ours(models.get("bf16", fp32), background=True),
        "ours int8": ours(models.get("int8", fp32)),
    }
    variants = {name: fn for name, fn in candidates.items()
                if name == "baseline" or name in wanted}
    lengths = [len(ids) for ids in tokenizer(texts, truncation=True,
                                              max_length=args.max_length)["input_ids"]]
    load_before = os.getloadavg()  # other processes on the machine skew the timings
    warm = texts[: args.batch_size]  # allocator, thread pool, kernels: untimed
    baseline_encode(baseline_model, tokenizer, warm, args.max_length, args.batch_size, device)
    for model in models.values():
        encode_texts(model, tokenizer, warm, args.max_length, args.batch_size, device)
    results, outputs = measure(variants, args.repeats, len(texts), device)
    agree = {name: agreement(outputs["baseline"], out,
                             MIN_COSINE if "fp32" in name else None)
             for name, out in outputs.items() if name != "baseline"}
    report = {
        "command": command_line(), "date": utc_now(),
        "machine": {**machine(str(device)), "load_average_before": load_before,
                    "load_average_after": os.getloadavg()},
        "params": {"model": args.model, "data": str(args.data), "docs": len(texts),
                   "max_length": args.max_length, "batch_size": args.batch_size,
                   "repeats": args.repeats, "threads": args.threads,
                   "max_tokens_per_batch": cap,
                   "mean_tokens": float(np.mean(lengths)),
                   "share_truncated": float(np.mean(np.array(lengths) >= args.max_length)),
                   "baseline_tokens": len(texts) * args.max_length,
                   "ours_tokens": padded_tokens(lengths, args.batch_size, cap)},
        "results": results, "agreement": agree,
    }
    name = "encode" if device.type == "cpu" else f"encode-{device.type}"
    write_report(args.out, name, report, render_compare(report))
    if not all(a["ok"] for a in agree.values()):
        print(f"fp32 embeddings disagree (min cosine <= {MIN_COSINE})", file=sys.stderr)
        return 1
    return 0


# -- MFU mode: docs/s and model FLOP utilisation ----------------------------------------------
def forward_flops(config: BertConfig, lengths: list[int]) -> float:
    """FLOPs of one forward pass over sequences of ``lengths`` (real tokens, padding excluded).

    Per token: 2 × the parameters of the transformer layers (every weight is one multiply-add)
    plus attention: QKᵀ and A·V cost 2·n·d each per layer for a sequence of n tokens.
    Embedding look-ups and pooling are negligible and not counted.
    """
    d, layers, ffn = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    per_layer = 4 * d * d + 2 * d * ffn  # Q, K, V, output projections + the two FFN matrices
    weights = 2 * layers * per_layer
    return float(sum(weights * n + layers * 4 * n * n * d for n in lengths))


def peak_flops(args: argparse.Namespace, device: torch.device) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in GPU_PEAK_BF16.items() if key in name), None)


def render_gpu(report: dict) -> str:
    p = report["params"]
    peak = report["peak_flops"]
    lines = [
        *_header(report, f"Encoding throughput and MFU ({p['arch']}, {p['device']})"),
        f"Params: encoder {p['arch']} ({p['params_m']:.1f} M parameters, random weights), "
        f"batch size {p['batch_size']}, repeats {p['repeats']}, SciFact docs {p['docs']}, "
        f"full-length sequences {p['synthetic_docs']}; peak "
        + (f"{peak / 1e12:.0f} TFLOP/s bf16 dense" if peak else "unknown (no MFU)"), "",
        "MFU = useful FLOPs (real tokens, 2 × layer parameters + attention) / time / peak.", "",
        "| input | length | variant | docs/s | tokens/s | TFLOP/s | MFU | ratio vs baseline |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "—"
        lines.append(f"| {row['input']} | {row['max_length']} | {row['variant']} | "
                     f"{row['docs_per_s']:.0f} | {row['tokens_per_s']:.0f} | "
                     f"{row['tflops']:.1f} | {mfu} | {row['ratio_vs_baseline']:.2f} |")
    return "\n".join(lines) + "\n"


def run_mfu(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    torch.manual_seed(0)
    tokenizer = load_tokenizer(args.model)
    config = BertConfig(vocab_size=tokenizer.vocab_size, max_position_embeddings=512,
                        **ARCHS[args.arch])
    encoder = BertModel(config, add_pooling_layer=False).to(device).eval()
    baseline_model = encoder  # fp32, transformers' default attention (SDPA)
    ours_model = prepare_model(BiEncoder(encoder).eval(), "bf16" if device.type == "cuda"
                               else "fp32", device)
    corpus = load_texts(args.data, args.docs)
    synthetic_docs = 4 * args.batch_size * (8 if device.type == "cuda" else 1)
    peak = peak_flops(args, device)
    rows = []
    load_before = os.getloadavg()
    for max_length in args.lengths:
        # Full-length sequences: words that tokenise to one token each, truncated at the length.
        full = [" ".join(["retrieval"] * max_length)] * synthetic_docs
        for label, texts in (("scifact", corpus), ("full-length", full)):
            lengths = [len(ids) for ids in tokenizer(texts, truncation=True,
                                                      max_length=max_length)["input_ids"]]
            flops = forward_flops(config, lengths)
            variants = {
                "baseline": lambda t=texts, n=max_length: baseline_encode(
                    baseline_model, tokenizer, t, n, args.batch_size, device),
                "ours": lambda t=texts, n=max_length: encode_texts(
                    ours_model, tokenizer, t, n, args.batch_size, device, background=True),
            }
            for fn in variants.values():  # warm-up: kernels, allocator
                timed(fn, device)
            results, _ = measure(variants, args.repeats, len(texts), device)
            for name, r in results.items():
                achieved = flops / r["seconds_median"]
                rows.append({"input": label, "max_length": max_length, "variant": name,
                             "docs": len(texts), "docs_per_s": r["docs_per_s"],
                             "tokens_per_s": sum(lengths) / r["seconds_median"],
                             "tflops": achieved / 1e12,
                             "mfu": achieved / peak if peak else None,
                             "ratio_vs_baseline": r["ratio_vs_baseline"],
                             "seconds": r["seconds"]})
    report = {
        "command": command_line(), "date": utc_now(),
        "machine": {**machine(str(device)), "load_average_before": load_before,
                    "load_average_after": os.getloadavg()},
        "params": {"arch": args.arch, "device": str(device), "docs": len(corpus),
                   "synthetic_docs": synthetic_docs, "batch_size": args.batch_size,
                   "repeats": args.repeats, "threads": torch.get_num_threads(),
                   "params_m": sum(p.numel() for p in encoder.parameters()) / 1e6},
        "peak_flops": peak, "rows": rows,
    }
    write_report(args.out, f"encode-{device.type}-{args.arch}", report, render_gpu(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    return run_mfu(args) if args.mode == "mfu" else run_compare(args)
