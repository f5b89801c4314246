"""FAISS on the GPU against FAISS on the CPU, on the same vectors, through ance-train's
``AnnIndex`` (index.device ``gpu`` vs ``cpu``): flat must return the same documents in the same
order (scores within float32 rounding), IVF the same documents at the same nprobe up to ties
at the cut; times are for one search of all queries. Writes one JSON file (argv[1]).

    python scripts/offline_gpu/faiss_gpu_sanity.py /tmp/faiss-sanity.json
"""

from __future__ import annotations

import json
import sys
import time

import faiss
import numpy as np

from ance_train.config import IndexConfig
from ance_train.index.ann import AnnIndex, faiss_gpus

DOCS, QUERIES, DIM, K = 200_000, 2_000, 384, 201  # K: ANCE's mining depth (top-200 + positive)


def build(kind: str, device: str, corpus: np.ndarray) -> AnnIndex:
    settings: dict = {"type": kind, "device": device}
    if kind == "ivf":
        settings["ivf"] = {"nlist": 1024, "nprobe": 32}
    index = AnnIndex(DIM, IndexConfig.model_validate(settings), "cosine", expected_size=DOCS)
    for start in range(0, DOCS, 50_000):
        index.add(np.arange(start, start + 50_000), corpus[start : start + 50_000])
    index.finalize()
    return index


def main() -> int:
    rng = np.random.default_rng(0)
    corpus = rng.standard_normal((DOCS, DIM), dtype=np.float32)
    queries = corpus[rng.choice(DOCS, QUERIES, replace=False)] + 0.5 * rng.standard_normal(
        (QUERIES, DIM), dtype=np.float32)
    report: dict = {"faiss": faiss.__version__, "gpus": faiss_gpus(), "docs": DOCS,
                    "queries": QUERIES, "dim": DIM, "k": K, "types": {}}
    ok = report["gpus"] > 0
    for kind in ("flat", "ivf"):
        row: dict = {}
        results = {}
        for device in ("cpu", "gpu"):
            started = time.perf_counter()
            index = build(kind, device, corpus)
            row[f"{device}_build_s"] = time.perf_counter() - started
            index.search(queries[:64], K)  # warm-up (kernels, JIT)
            started = time.perf_counter()
            results[device] = index.search(queries, K)
            row[f"{device}_search_s"] = time.perf_counter() - started
            row[f"{device}_on_gpu"] = bool(index._on_gpu)
        (cpu_ids, cpu_scores), (gpu_ids, gpu_scores) = results["cpu"], results["gpu"]
        row["same_order_rows"] = float(np.mean((cpu_ids == gpu_ids).all(1)))
        row["same_set_overlap"] = float(np.mean([len(np.intersect1d(a, b)) / K
                                                 for a, b in zip(cpu_ids, gpu_ids, strict=True)]))
        row["max_score_diff"] = float(np.abs(np.sort(cpu_scores, 1)
                                             - np.sort(gpu_scores, 1)).max())
        row["search_speedup"] = row["cpu_search_s"] / row["gpu_search_s"]
        report["types"][kind] = row
        print(kind, json.dumps(row))
        ok &= row["gpu_on_gpu"] and row["same_set_overlap"] > (0.999 if kind == "flat" else 0.99)
    report["ok"] = bool(ok)
    with open(sys.argv[1], "w", encoding="utf-8") as out:
        json.dump(report, out, indent=2)
    print("ok" if ok else "NOT OK", report["faiss"], "GPUs:", report["gpus"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
