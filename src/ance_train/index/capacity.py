"""Capacity planning (``ance-train plan``): refresh period, storage per checkpoint and index
memory predicted from the corpus size, embedding dimension, replicas and measured throughput.

The index terms count work in multiply-adds ("ops") for each index type and phase
(``index_work``) and divide by a rate measured on this kind of machine (``IndexRates``,
fitted by ``bench/indexer.py`` and stored in ``docs/benchmarks/indexer.json``). Sizes and
shapes of the FAISS structures (``index_bytes``, ``ivf_lists``) are shared with
``ance_train.index.ann``, which builds them, so plan and index never disagree.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ance_train.config import IndexConfig, RunConfig

MIN_POINTS_PER_LIST = 39  # FAISS k-means warns below this many training points per centroid
KMEANS_ITERS_IVF = 10  # FAISS IndexIVF coarse quantiser: ClusteringParameters.niter = 10
KMEANS_ITERS_PQ = 25  # FAISS ProductQuantizer: ClusteringParameters default niter = 25
PQ_MAX_TRAIN_PER_CENTROID = 256  # FAISS samples at most 256 points per centroid
# A PQ code look-up + add is scalar (~1 per cycle); a BLAS multiply-add runs 16 per cycle
# (AVX2 FMA on 8 floats, 2 ports). Set after the 1M run of bench/indexer.py showed ivfpq
# search time following the codes scanned (12× time for 12.6× codes).
PQ_LOOKUP_OPS = 16
ID_BYTES = 8  # int64 document index per row (FAISS ids, AnnIndex row → document map)
VECTOR_BYTES = 4  # float32
# Bytes per negatives-table cell: candidate int64 + score f32 + probability f32 + source
# int8 + first-seen int64 (negatives/table.py).
NEGATIVE_CELL_BYTES = 8 + 4 + 4 + 1 + 8
ADAM_STATE_PER_PARAM = 2  # exp_avg and exp_avg_sq, float32 each, saved for resume
MINILM_PARAMS = 22_713_216  # all-MiniLM-L6-v2 (the default model)

# Measured by ``bench/indexer.py`` (docs/benchmarks/indexer.json, 2 shared CPU cores, 384-d,
# 2000 queries, top-201): ops per second of each index type and phase, and mining cells
# (query × candidate) per second. Geometric mean of the rates fitted at 100k and at 1M docs
# (hnsw: 100k only); the two differ by up to 3.6× because the machine's load changed during
# the run (1-min load 10.6 → 3.6). ``--calibration`` replaces them with another run's fit.
DEFAULT_RATES: dict[str, float] = {
    "flat/build": 9.5e7, "flat/search": 1.0e10,
    "ivf/build": 1.9e10, "ivf/search": 4.1e9,
    "ivfpq/build": 5.9e9, "ivfpq/search": 8.0e9,
    "hnsw/build": 1.3e9, "hnsw/search": 2.8e9,
    "mine": 4.7e6,
}


def default_nlist(num_vectors: int) -> int:
    """FAISS wiki ("Guidelines to choose an index"): K = 4·sqrt(N) inverted lists."""
    return max(1, round(4 * math.sqrt(num_vectors)))


def ivf_lists(config: IndexConfig, num_vectors: int) -> int:
    """Inverted lists actually used: ``index.ivf.nlist`` (or 4·sqrt(N)), at most N/39."""
    wanted = config.ivf.nlist or default_nlist(num_vectors)
    return max(1, min(wanted, num_vectors // MIN_POINTS_PER_LIST))


def ivf_train_size(config: IndexConfig, num_vectors: int) -> int:
    """Vectors the coarse k-means is trained on: nlist × ``train_points_per_list``."""
    nlist = config.ivf.nlist or default_nlist(num_vectors)
    return min(num_vectors, nlist * config.ivf.train_points_per_list)


def pq_m(config: IndexConfig, dim: int) -> int:
    """Sub-quantisers of ``ivfpq``: ``index.pq.m`` or dim/8; must divide ``dim``."""
    m = config.pq.m or max(1, dim // 8)
    if dim % m:
        raise ValueError(f"index.pq.m ({m}) must divide the embedding dimension {dim}")
    return m


def index_bytes(config: IndexConfig, num_vectors: int, dim: int) -> int:
    """Memory of the FAISS index plus ``AnnIndex``'s row → document map."""
    n, d = num_vectors, dim
    kind = config.type
    if kind == "flat":
        size = n * d * VECTOR_BYTES
    elif kind == "hnsw":
        m = config.hnsw.m
        links = 2 * m + m / max(m - 1, 1)  # level 0 holds 2M, upper levels M·1/(M-1) on average
        size = n * d * VECTOR_BYTES + int(n * links * 4) + n * (8 + 4)  # links, offsets, levels
    else:
        nlist = ivf_lists(config, n)
        centroids = nlist * d * VECTOR_BYTES
        direct_map = n * ID_BYTES  # reconstruct by row (AnnIndex.vectors)
        if kind == "ivf":
            code = d * VECTOR_BYTES
        else:
            m = pq_m(config, d)
            code = math.ceil(m * config.pq.nbits / 8)
            centroids += (2 ** config.pq.nbits) * d * VECTOR_BYTES  # PQ codebooks
        size = n * (code + ID_BYTES) + centroids + direct_map
    return size + n * ID_BYTES


def index_work(config: IndexConfig, phase: str, num_vectors: int, dim: int, queries: int = 0,
               k: int = 0) -> float:
    """Multiply-adds (or comparable steps) of building the index or searching it."""
    n, d = num_vectors, dim
    kind = config.type
    if kind == "flat":
        return float(n * d) if phase == "build" else float(queries) * n * d
    if kind == "hnsw":
        log_n = math.log2(max(n, 2))
        if phase == "build":
            return float(n) * config.hnsw.ef_construction * d * log_n
        return float(queries) * max(config.hnsw.ef_search, k) * d * log_n
    nlist = ivf_lists(config, n)
    nprobe = min(config.ivf.nprobe, nlist)
    if phase == "build":
        train = ivf_train_size(config, n)
        work = KMEANS_ITERS_IVF * train * nlist * d + n * nlist * d
        if kind == "ivfpq":
            ksub = 2 ** config.pq.nbits
            pq_train = min(train, PQ_MAX_TRAIN_PER_CENTROID * ksub)
            work += KMEANS_ITERS_PQ * pq_train * ksub * d + n * ksub * d
        return float(work)
    per_query = nlist * d  # coarse assignment
    if kind == "ivf":
        per_query += nprobe * (n / nlist) * d
    else:
        # Inner-product tables once per query (FAISS IVFPQ, IP metric), then per scanned
        # code m scalar table look-ups, each counted as PQ_LOOKUP_OPS vectorised ops.
        per_query += (2 ** config.pq.nbits) * d
        per_query += PQ_LOOKUP_OPS * nprobe * (n / nlist) * pq_m(config, d)
    return float(queries) * per_query


@dataclass(frozen=True)
class IndexRates:
    """Ops per second of each ``type/phase`` and mining cells per second (``mine``)."""

    rates: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_RATES))
    source: str = "built-in rates (docs/benchmarks/indexer.json, 2-core machine)"

    @classmethod
    def from_benchmark(cls, path: str | Path) -> IndexRates:
        """The ``fit`` section written by ``bench/indexer.py``."""
        report = json.loads(Path(path).read_text())
        return cls({**DEFAULT_RATES, **report["fit"]["rates"]}, str(path))

    def seconds(self, key: str, work: float) -> float:
        return work / self.rates[key]


@dataclass(frozen=True)
class Workload:
    """What ``ance-train plan`` predicts from (sizes in items, rates per second)."""

    docs: int
    dim: int
    replicas: int
    docs_per_s: float  # one replica, at ``doc_tokens``
    train_queries: int
    eval_queries: int = 0
    doc_tokens: int = 256
    query_tokens: int = 32
    shard_size: int = 1000
    query_shard_size: int = 2000
    mine_depth: int = 200  # negatives.top_k (or SimANS k) + a margin for the positives
    eval_depth: int = 1000
    store_mb_s: float = 200.0  # object store bandwidth seen by one process
    model_params: int = MINILM_PARAMS
    index: IndexConfig = field(default_factory=IndexConfig)


@dataclass(frozen=True)
class Plan:
    seconds: dict[str, float]  # components of one refresh, in order
    refresh_s: float
    storage_bytes: dict[str, int]  # per checkpoint
    index_bytes: int
    indexer_bytes: int  # 2 indexes + queries + search results + 2 negatives (no runtime)

    def to_dict(self) -> dict:
        return asdict(self)


def encode_seconds(load: Workload) -> float:
    """Corpus and query shards spread over the replicas in waves (the slowest wave counts)."""
    corpus_shards = math.ceil(load.docs / load.shard_size)
    corpus_shard_s = min(load.shard_size, load.docs) / load.docs_per_s
    total_queries = load.train_queries + load.eval_queries
    query_rate = load.docs_per_s * load.doc_tokens / max(load.query_tokens, 1)
    query_shards = math.ceil(total_queries / load.query_shard_size)
    query_shard_s = min(load.query_shard_size, total_queries) / query_rate
    return (math.ceil(corpus_shards / load.replicas) * corpus_shard_s
            + math.ceil(query_shards / load.replicas) * query_shard_s)


def plan(load: Workload, rates: IndexRates | None = None) -> Plan:
    """Predict one refresh (checkpoint saved → negatives ready), storage and memory."""
    rates = rates or IndexRates()
    cfg, n, d = load.index, load.docs, load.dim
    store_rate = load.store_mb_s * 1e6
    row_bytes = d * VECTOR_BYTES + ID_BYTES
    embeddings = (n + load.train_queries + load.eval_queries) * row_bytes
    weights = load.model_params * VECTOR_BYTES
    checkpoint = weights * (1 + ADAM_STATE_PER_PARAM)
    negatives = load.train_queries * load.mine_depth * NEGATIVE_CELL_BYTES
    seconds = {
        # The trainer uploads weights + optimizer state; each inferencer downloads weights.
        "checkpoint_transfer": (checkpoint + weights) / store_rate,
        "encode": encode_seconds(load),
        # Uploads overlap encoding except the last shard's; the indexer reads every shard.
        "embedding_transfer": (embeddings + load.shard_size * row_bytes) / store_rate,
        "index_build": rates.seconds(f"{cfg.type}/build", index_work(cfg, "build", n, d)),
        "search_train": rates.seconds(f"{cfg.type}/search", index_work(
            cfg, "search", n, d, load.train_queries, load.mine_depth)),
        "mine": load.train_queries * load.mine_depth / rates.rates["mine"],
        "search_eval": rates.seconds(f"{cfg.type}/search", index_work(
            cfg, "search", n, d, load.eval_queries, load.eval_depth)),
        "negatives_upload": negatives / store_rate,
    }
    memory = index_bytes(cfg, n, d)
    # The previous index keeps serving Search while the next one is built: two at the peak;
    # likewise the previous negatives table (the base of the next one) and the new one.
    indexer = (2 * memory + (load.train_queries + load.eval_queries) * d * VECTOR_BYTES
               + load.train_queries * load.mine_depth * (ID_BYTES + VECTOR_BYTES)
               + 2 * negatives)
    return Plan(seconds=seconds, refresh_s=sum(seconds.values()),
                storage_bytes={"checkpoint": checkpoint, "embeddings": embeddings,
                               "negatives": negatives,
                               "total": checkpoint + embeddings + negatives},
                index_bytes=memory, indexer_bytes=indexer)


def throughput_from_benchmark(path: str | Path) -> tuple[float, float]:
    """(docs/s of one replica, tokens per document it was measured at) from a
    ``bench/encode.py`` report (``ours`` or ``ours fp32``) or a ``bench/refresh_scaling.py``
    report (``per_replica_docs_per_s`` and ``doc_tokens``)."""
    report = json.loads(Path(path).read_text())
    if "per_replica_docs_per_s" in report:
        return float(report["per_replica_docs_per_s"]), float(report["doc_tokens"])
    ours = [name for name in ("ours", "ours fp32") if name in report.get("results", {})]
    if ours:
        params = report["params"]
        tokens = params.get("mean_tokens") or params["max_length"]
        return float(report["results"][ours[0]]["docs_per_s"]), float(tokens)
    raise ValueError(f"{path}: neither a bench/encode.py nor a bench/refresh_scaling.py "
                     "report (no results.ours[ fp32].docs_per_s or per_replica_docs_per_s)")


def scale_throughput(docs_per_s: float, measured_tokens: float, doc_tokens: float) -> float:
    """Throughput at another document length, assuming cost linear in tokens (the feed-forward
    and projection layers dominate below ~512 tokens; attention's quadratic term is ignored)."""
    return docs_per_s * measured_tokens / doc_tokens


def workload(*, docs: int, dim: int, replicas: int, docs_per_s: float, train_queries: int,
             eval_queries: int = 0, doc_tokens: int = 256, query_tokens: int = 32,
             store_mb_s: float = 200.0, model_params: int | None = None,
             config: RunConfig | None = None, index_type: str | None = None) -> Workload:
    """A :class:`Workload`; a run configuration supplies the index settings, shard sizes,
    mining and evaluation depths and caps the token counts at the model's max lengths."""
    extra: dict = {}
    index = config.index if config else IndexConfig()
    if config is not None:
        neg = config.negatives
        extra = {"shard_size": config.inference.shard_size,
                 "query_shard_size": config.inference.query_shard_size,
                 "mine_depth": max(100, neg.sampling_strategy.depth()),
                 "eval_depth": config.index.eval_depth}
        doc_tokens = min(doc_tokens, config.model.max_doc_length)
        query_tokens = min(query_tokens, config.model.max_query_length)
    if index_type is not None:
        index = IndexConfig.model_validate({**index.model_dump(exclude_unset=True),
                                            "type": index_type})
    return Workload(docs=docs, dim=dim, replicas=replicas, docs_per_s=docs_per_s,
                    train_queries=train_queries, eval_queries=eval_queries,
                    doc_tokens=doc_tokens, query_tokens=query_tokens, store_mb_s=store_mb_s,
                    model_params=model_params or MINILM_PARAMS, index=index, **extra)


def describe(load: Workload) -> dict:
    """The workload as JSON-ready values."""
    return {**asdict(load), "index": load.index.model_dump(mode="json")}


def _size(num_bytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(num_bytes) < 1000 or unit == "GB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{num_bytes:.0f} B"
        num_bytes /= 1000
    return f"{num_bytes:.1f} TB"  # unreachable


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def render(load: Workload, result: Plan, rates: IndexRates) -> str:
    """A plain-text report of a plan."""
    lines = [f"{load.docs:,} docs × {load.dim}-d, {load.replicas} replica(s) at "
             f"{load.docs_per_s:,.1f} docs/s each ({load.doc_tokens} tokens/doc), "
             f"{load.train_queries:,} training + {load.eval_queries:,} eval queries, "
             f"index {load.index.type}", "", "refresh (checkpoint saved → negatives ready):"]
    for name, seconds in result.seconds.items():
        share = seconds / result.refresh_s if result.refresh_s else 0.0
        lines.append(f"  {name:<20} {_duration(seconds):>10}  {share:6.1%}")
    lines += [f"  {'total':<20} {_duration(result.refresh_s):>10}", "",
              "storage per checkpoint:"]
    lines += [f"  {name:<20} {_size(size):>10}" for name, size in result.storage_bytes.items()]
    lines += ["", f"index memory: {_size(result.index_bytes)}; indexer working set beyond the "
                  f"runtime: {_size(result.indexer_bytes)}", f"index rates: {rates.source}"]
    return "\n".join(lines)
