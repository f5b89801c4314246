"""Capacity planning (``ance-train plan``): refresh period, storage per checkpoint and index
memory predicted from the corpus size, embedding dimension, replicas and measured throughput.

With MaxP (``data.passages.mode: max``) every term that counts vectors counts passages
(:class:`Workload` ``passages_per_doc``): see :func:`workload` and :func:`passage_cost`.

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

import numpy as np

from ance_train.config import IndexConfig, PassagesConfig, RunConfig

MIN_POINTS_PER_LIST = 39  # FAISS k-means warns below this many training points per centroid
KMEANS_ITERS_IVF = 10  # FAISS IndexIVF coarse quantiser: ClusteringParameters.niter = 10
KMEANS_ITERS_PQ = 25  # FAISS ProductQuantizer: ClusteringParameters default niter = 25
PQ_MAX_TRAIN_PER_CENTROID = 256  # FAISS samples at most 256 points per centroid
# A PQ code look-up + add is scalar (~1 per cycle); a BLAS multiply-add runs 16 per cycle
# (AVX2 FMA on 8 floats, 2 ports). Set after the 1M run of bench/indexer.py showed ivfpq
# search time following the codes scanned (12× time for 12.6× codes).
PQ_LOOKUP_OPS = 16
HNSW_QUANTIZER_M = 32  # graph degree of ``index.ivf.quantizer: hnsw`` (FAISS's "HNSW32")
HNSW_QUANTIZER_EF_CONSTRUCTION = 40  # FAISS IndexHNSW's default efConstruction
ID_BYTES = 8  # int64 document index per row (FAISS ids, AnnIndex row → document map)
PASSAGE_BYTES = 2  # int16 passage number per row of a MaxP corpus shard
VECTOR_BYTES = 4  # float32 (FAISS works in float32 whatever the stored shards hold)
RESULT_CELL_BYTES = 8 + 4  # a search result: document index int64 + score float32
# FAISS's ArrayInvertedLists keep each list in a std::vector grown by doubling as shards are
# added: capacity is 1 to 2 times the size, 1.5 taken (measured: 1.3 at 1M vectors, 32-d).
IVF_LIST_GROWTH = 1.5
MERGE_CACHE_SHARDS = 4  # corpus shards partition 0 keeps read back (MergedIndex cache_shards)
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
# ``merge``: result cells (query × candidate of one partition) per second merged into the
# global top-K, timed on the same machine on 2026-11-23 (20,000 queries, 4 lists of 200:
# argpartition + sort of the concatenated lists, 3.7e7 cells/s). ``ivf-quantizer/hnsw``: the
# walk of an HNSW coarse quantizer over 65,536 centroids at efSearch 128, by
# ``bench/quantizer.py`` (docs/benchmarks/quantizer.json, same machine, 2026-11-23); its graph
# is built at the ``hnsw/build`` rate.
DEFAULT_RATES: dict[str, float] = {
    "flat/build": 9.5e7, "flat/search": 1.0e10,
    "ivf/build": 1.9e10, "ivf/search": 4.1e9,
    "ivfpq/build": 5.9e9, "ivfpq/search": 8.0e9,
    "hnsw/build": 1.3e9, "hnsw/search": 2.8e9,
    "ivf-quantizer/hnsw": 2.6e9,
    "mine": 4.7e6, "merge": 3.7e7,
}
RATES_CPUS = 2  # cores of the machine DEFAULT_RATES were measured on


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
        size = n * d * VECTOR_BYTES + _hnsw_graph_bytes(n, config.hnsw.m)
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
        if config.ivf.quantizer == "hnsw":
            centroids += _hnsw_graph_bytes(nlist, HNSW_QUANTIZER_M)
        size = n * (code + ID_BYTES) + centroids + direct_map
    return size + n * ID_BYTES


def index_memory_bytes(config: IndexConfig, num_vectors: int, dim: int) -> int:
    """What the index holds in memory: :func:`index_bytes` (its serialised size), plus the
    spare capacity of IVF lists grown shard by shard (``IVF_LIST_GROWTH``)."""
    size = index_bytes(config, num_vectors, dim)
    if config.type in ("ivf", "ivfpq"):
        code = (dim * VECTOR_BYTES if config.type == "ivf"
                else math.ceil(pq_m(config, dim) * config.pq.nbits / 8))
        size += math.ceil(num_vectors * (code + ID_BYTES) * (IVF_LIST_GROWTH - 1))
    return size


def _hnsw_graph_bytes(nodes: int, m: int) -> int:
    """Links, offsets and levels of an HNSW graph (level 0 holds 2M links, the upper levels
    M·1/(M-1) on average)."""
    links = 2 * m + m / max(m - 1, 1)
    return int(nodes * links * 4) + nodes * (8 + 4)


def index_work(config: IndexConfig, phase: str, num_vectors: int, dim: int, queries: int = 0,
               k: int = 0) -> float:
    """Multiply-adds (or comparable steps) of building the index or searching it."""
    return sum(index_work_parts(config, phase, num_vectors, dim, queries, k).values())


def index_work_parts(config: IndexConfig, phase: str, num_vectors: int, dim: int,
                     queries: int = 0, k: int = 0) -> dict[str, float]:
    """:func:`index_work` by the rate it runs at (keys of ``IndexRates``): an HNSW coarse
    quantizer's graph is built at ``hnsw/build`` and walked at ``ivf-quantizer/hnsw``; the
    rest, a flat quantizer's assignment included, runs at the index type's
    ``type/phase`` rate, as ``bench/indexer.py`` fits it."""
    n, d = num_vectors, dim
    kind = config.type
    key = f"{kind}/{phase}"
    if kind == "flat":
        return {key: float(n * d) if phase == "build" else float(queries) * n * d}
    if kind == "hnsw":
        log_n = math.log2(max(n, 2))
        if phase == "build":
            return {key: float(n) * config.hnsw.ef_construction * d * log_n}
        return {key: float(queries) * max(config.hnsw.ef_search, k) * d * log_n}
    nlist = ivf_lists(config, n)
    nprobe = min(config.ivf.nprobe, nlist)
    graph = config.ivf.quantizer == "hnsw"
    # Finding a vector's nearest lists: every centroid (flat), or a walk of the centroid
    # graph (hnsw: ef candidates × log2(nlist) hops, as for an HNSW index).
    assign = (config.ivf.quantizer_ef_search * d * math.log2(max(nlist, 2)) if graph
              else nlist * d)
    parts: dict[str, float] = {}
    if phase == "build":
        train = ivf_train_size(config, n)
        work: float = KMEANS_ITERS_IVF * train * nlist * d
        if kind == "ivfpq":
            ksub = 2 ** config.pq.nbits
            pq_train = min(train, PQ_MAX_TRAIN_PER_CENTROID * ksub)
            work += KMEANS_ITERS_PQ * pq_train * ksub * d + n * ksub * d
        if graph:
            parts["hnsw/build"] = (nlist * HNSW_QUANTIZER_EF_CONSTRUCTION * d
                                   * math.log2(max(nlist, 2)))
            parts["ivf-quantizer/hnsw"] = n * assign
        else:
            work += n * assign
        parts[key] = float(work)
        return parts
    per_query = 0.0 if graph else assign
    if kind == "ivf":
        per_query += nprobe * (n / nlist) * d
    else:
        # Inner-product tables once per query (FAISS IVFPQ, IP metric), then per scanned
        # code m scalar table look-ups, each counted as PQ_LOOKUP_OPS vectorised ops.
        per_query += (2 ** config.pq.nbits) * d
        per_query += PQ_LOOKUP_OPS * nprobe * (n / nlist) * pq_m(config, d)
    parts[key] = float(queries) * per_query
    if graph:
        parts["ivf-quantizer/hnsw"] = float(queries) * assign
    return parts


@dataclass(frozen=True)
class IndexRates:
    """Ops per second of each ``type/phase`` and mining cells per second (``mine``)."""

    rates: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_RATES))
    source: str = "built-in rates (docs/benchmarks/indexer.json, 2-core machine)"
    cpus: int = RATES_CPUS  # cores of the machine the rates were measured on

    @classmethod
    def from_benchmark(cls, path: str | Path) -> IndexRates:
        """The ``fit`` section written by ``bench/indexer.py``."""
        report = json.loads(Path(path).read_text())
        cpus = int(report.get("machine", {}).get("cores") or RATES_CPUS)
        return cls({**DEFAULT_RATES, **report["fit"]["rates"]}, str(path), cpus)

    def seconds(self, key: str, work: float) -> float:
        return work / self.rates[key]

    def index_seconds(self, config: IndexConfig, phase: str, num_vectors: int, dim: int,
                      queries: int = 0, k: int = 0, cpus: int | None = None) -> float:
        """Seconds of :func:`index_work` on a pod with ``cpus`` cores (default: the cores the
        rates were measured on). FAISS builds and searches in parallel over OpenMP threads;
        the rates are scaled linearly with the cores — an assumption, an upper bound of the
        speed-up (docs/deployment.md)."""
        scale = (cpus or self.cpus) / self.cpus
        return sum(work / (self.rates[key] * scale) for key, work in
                   index_work_parts(config, phase, num_vectors, dim, queries, k).items())


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
    partitions: int = 1  # index.partitions: indexer processes, each over 1/P of the shards
    embedding_bytes: int = VECTOR_BYTES  # per value in a shard: 4 float32, 2 float16
    indexer_cpus: int | None = None  # cores of each indexer pod (None: the rates' machine)
    # The indexer adds each shard as it is encoded (index.build_while_encoding): only the
    # build work encoding does not hide, plus the last shard's, stays on the refresh.
    overlap_build: bool = False
    rate: str = ""  # where docs_per_s comes from (Throughput.describe), for the report
    # MaxP (data.passages.mode max): each document is passages_per_doc vectors on average,
    # searched k × max_passages deep; doc_tokens is then its first passage's tokens and
    # passage_tokens a full passage's (data.passages.length or model.max_doc_length).
    maxp: bool = False
    passages_per_doc: float = 1.0
    max_passages: int = 1
    passage_tokens: int = 0

    def rows(self, docs: int) -> int:
        """Vectors (shard rows, index entries) of ``docs`` documents: one each (FirstP), or
        ``passages_per_doc`` each on average (MaxP)."""
        return round(docs * self.passages_per_doc) if self.maxp else docs

    @property
    def vectors(self) -> int:
        """Vectors of the whole corpus."""
        return self.rows(self.docs)

    @property
    def tokens_per_doc(self) -> float:
        """Tokens encoded per document: ``doc_tokens`` (FirstP); with MaxP the first passage's
        ``doc_tokens`` plus ``passages_per_doc - 1`` further passages counted full
        (``passage_tokens``). Assumed: a document long enough for a second passage fills
        every passage but its last, and the last is padded to its batch's longest sequence,
        so a document's tokens spread over full passages (an upper bound when the corpus
        ends many documents in short passages)."""
        if not self.maxp:
            return self.doc_tokens
        return self.doc_tokens + (self.passages_per_doc - 1) * self.passage_tokens

    def depth(self, k: int) -> int:
        """Rows a search for the top ``k`` documents asks the index for: ``k × max_passages``
        with MaxP (index.passages.PassageIndex collapses them to ``k`` documents)."""
        return k * self.max_passages if self.maxp else k


@dataclass(frozen=True)
class Plan:
    seconds: dict[str, float]  # components of one refresh on its critical path, in order
    refresh_s: float
    storage_bytes: dict[str, int]  # per checkpoint
    index_bytes: int  # one partition's index (the whole index when partitions = 1)
    indexer_bytes: int  # the largest indexer pod, partition 0, which also merges and mines
    partition_bytes: int  # any other partition: 2 indexes + its build or search buffers
    pods: dict[str, int]  # role → pods (inferencer, indexer)
    hidden_seconds: dict[str, float] = field(default_factory=dict)  # overlapped with encoding

    def to_dict(self) -> dict:
        return asdict(self)


def encode_seconds(load: Workload) -> float:
    """Corpus and query shards spread over the replicas in waves (the slowest wave counts).
    A corpus shard holds ``shard_size`` documents (with MaxP all their passages); its time
    grows with the tokens encoded per document (:attr:`Workload.tokens_per_doc`, cost linear
    in tokens as in :func:`scale_throughput`)."""
    corpus_shards = math.ceil(load.docs / load.shard_size)
    corpus_shard_s = min(load.shard_size, load.docs) / load.docs_per_s
    if load.maxp:
        corpus_shard_s *= load.tokens_per_doc / load.doc_tokens
    total_queries = load.train_queries + load.eval_queries
    query_rate = load.docs_per_s * load.doc_tokens / max(load.query_tokens, 1)
    query_shards = math.ceil(total_queries / load.query_shard_size)
    query_shard_s = min(load.query_shard_size, total_queries) / query_rate
    return (math.ceil(corpus_shards / load.replicas) * corpus_shard_s
            + math.ceil(query_shards / load.replicas) * query_shard_s)


def plan(load: Workload, rates: IndexRates | None = None) -> Plan:
    """Predict one refresh (checkpoint saved → negatives ready), storage and memory.

    With ``partitions`` P, each indexer pod holds the index of 1/P of the corpus and searches
    every query in it; the pods work in parallel, so the per-partition terms count once.
    Partition 0 then fetches the P partial result lists, merges them into the global top-K,
    mines and uploads the table (``partial_transfer``, ``merge``, ``mine``,
    ``negatives_upload``).

    With MaxP every corpus term counts passages (:meth:`Workload.rows`): shard rows (plus
    ``PASSAGE_BYTES`` each), index vectors and the row map, build work; searches ask for
    ``k × max_passages`` rows (:meth:`Workload.depth`, which only HNSW's search work
    depends on: flat and IVF scans cost the vectors scanned, whatever the depth), and
    ``best_passage`` adds collapsing those lists to documents and choosing each mined
    candidate's best passage. Partial lists, the merge and mining stay in documents.
    """
    rates = rates or IndexRates()
    cfg, d, parts = load.index, load.dim, max(1, load.partitions)
    n = load.rows(math.ceil(load.docs / parts))  # vectors of one partition
    shard_rows = load.rows(min(load.shard_size, load.docs))  # rows of one corpus shard
    queries = load.train_queries + load.eval_queries
    store_rate = load.store_mb_s * 1e6
    row_bytes = d * load.embedding_bytes + ID_BYTES
    corpus_row_bytes = row_bytes + (PASSAGE_BYTES if load.maxp else 0)
    embeddings = load.vectors * corpus_row_bytes + queries * row_bytes
    weights = load.model_params * VECTOR_BYTES
    checkpoint = weights * (1 + ADAM_STATE_PER_PARAM)
    negatives = load.train_queries * load.mine_depth * NEGATIVE_CELL_BYTES
    # One partition's search results: every training query to the mining depth and every
    # evaluation query to the evaluation depth.
    results = (load.train_queries * load.mine_depth
               + load.eval_queries * load.eval_depth) * RESULT_CELL_BYTES
    cpus = load.indexer_cpus
    encode = encode_seconds(load)
    # Each partition reads its corpus shards and every query shard. Uploads overlap encoding
    # except the last shard's.
    transfer = ((n + load.rows(load.shard_size)) * corpus_row_bytes
                + queries * row_bytes) / store_rate
    build = rates.index_seconds(cfg, "build", n, d, cpus=cpus)
    hidden: dict[str, float] = {}
    if load.overlap_build:
        # Shards are added as they arrive: what encoding hides is gone from the critical
        # path; the last shard's add (its share of the build) always remains.
        last_shard = build * min(1.0, load.rows(load.shard_size) / max(n, 1))
        tail = max(build - encode, 0.0) + last_shard
        hidden["index_build"] = build - tail
        build = tail
        corpus_transfer = n * corpus_row_bytes / store_rate
        hidden["embedding_transfer"] = min(corpus_transfer, encode)
        transfer -= hidden["embedding_transfer"]
    seconds = {
        # The trainer uploads weights + optimizer state; each inferencer downloads weights.
        "checkpoint_transfer": (checkpoint + weights) / store_rate,
        "encode": encode,
        "embedding_transfer": transfer,
        "index_build": build,
        "search_train": rates.index_seconds(cfg, "search", n, d, load.train_queries,
                                            load.depth(load.mine_depth), cpus=cpus),
        "search_eval": rates.index_seconds(cfg, "search", n, d, load.eval_queries,
                                           load.depth(load.eval_depth), cpus=cpus),
    }
    passage_results = 0
    if load.maxp:
        # Each partition sorts its k × max_passages lists to documents (as merge sorts
        # cells); partition 0 scores every passage of each mined candidate (dot products, at
        # the flat scan's rate) to pick the one the trainer trains on.
        passage_results = results // RESULT_CELL_BYTES * load.max_passages  # cells
        choose = load.train_queries * load.mine_depth * load.max_passages * d
        seconds["best_passage"] = (passage_results / rates.rates["merge"]
                                   + rates.seconds("flat/search", choose))
    if parts > 1:
        # Every partition uploads its lists in parallel; partition 0 downloads all P.
        seconds["partial_transfer"] = (1 + parts) * results / store_rate
        seconds["merge"] = parts * results / RESULT_CELL_BYTES / rates.rates["merge"]
    seconds["mine"] = load.train_queries * load.mine_depth / rates.rates["mine"]
    seconds["negatives_upload"] = negatives / store_rate
    memory = index_memory_bytes(cfg, n, d)
    # The previous index keeps serving Search while the next one is built: two at the peak,
    # plus the larger of what building and searching hold beside them.
    shard_bytes = shard_rows * (d * (load.embedding_bytes + VECTOR_BYTES) + ID_BYTES
                                + (PASSAGE_BYTES if load.maxp else 0))  # stored + float32
    building = shard_bytes
    if cfg.type in ("ivf", "ivfpq"):  # the k-means sample, pending and then concatenated
        building += 2 * ivf_train_size(cfg, n) * d * VECTOR_BYTES
    # The query vectors and the lists; a partition also packs its lists to store them (the
    # buffer and its bytes: two more copies).
    # MaxP: the passage lists (k × max_passages deep) beside the document lists.
    searching = (queries * d * VECTOR_BYTES + results * (3 if parts > 1 else 1)
                 + passage_results * RESULT_CELL_BYTES)
    partition = 2 * memory + max(building, searching)
    # Partition 0 also holds the other partitions' lists while merging, and the previous
    # negatives table (the base of the next one) beside the new one; with partitions, the
    # merged lists and the corpus shards it reads vectors back from.
    indexer = partition + (parts - 1) * results + 2 * negatives
    if parts > 1:
        indexer += results + MERGE_CACHE_SHARDS * shard_rows * (d * VECTOR_BYTES + ID_BYTES)
    partials = parts * results if parts > 1 else 0
    storage = {"checkpoint": checkpoint, "embeddings": embeddings, "negatives": negatives}
    if partials:
        storage["partial_results"] = partials
    storage["total"] = sum(storage.values())
    return Plan(seconds=seconds, refresh_s=sum(seconds.values()), storage_bytes=storage,
                index_bytes=memory, indexer_bytes=indexer, partition_bytes=partition,
                pods={"inferencer": load.replicas, "indexer": parts},
                hidden_seconds=hidden)


@dataclass(frozen=True)
class Throughput:
    """A measured encoding rate of one inferencer replica: ``docs_per_s`` at ``tokens`` per
    document (mean, after truncation), with the weights in ``precision`` (None: not known),
    taken from ``source`` (a report's file and row, or the command line)."""

    docs_per_s: float
    tokens: float
    precision: str | None
    source: str

    def at(self, doc_tokens: float) -> float:
        """The rate at ``doc_tokens`` per document (:func:`scale_throughput`)."""
        return scale_throughput(self.docs_per_s, self.tokens, doc_tokens)

    def describe(self, doc_tokens: float) -> str:
        """What ``plan`` says of the rate it used at ``doc_tokens``."""
        precision = self.precision or "precision not recorded"
        rescaled = (f", rescaled from {self.docs_per_s:,.1f} docs/s at {self.tokens:g} tokens"
                    if doc_tokens != self.tokens else "")
        return (f"{self.at(doc_tokens):,.1f} docs/s per replica at {doc_tokens:g} tokens/doc, "
                f"{precision}: {self.source}{rescaled}")


def throughput_from_benchmark(path: str | Path, precision: str = "fp32") -> Throughput:
    """The rate of one replica from a ``bench/encode.py`` report (its row ``ours
    <precision>``; ``ours`` in reports older than the precision rows, which were fp32) or a
    ``bench/refresh_scaling.py`` report (``per_replica_docs_per_s`` at ``doc_tokens``, at the
    precision it ran with)."""
    report = json.loads(Path(path).read_text())
    if "per_replica_docs_per_s" in report:
        measured = report.get("params", {}).get("precision")
        return Throughput(float(report["per_replica_docs_per_s"]), float(report["doc_tokens"]),
                          measured, f"{path} (per_replica_docs_per_s)")
    results = report.get("results", {})
    rows = [f"ours {precision}"] + (["ours"] if precision == "fp32" else [])
    row = next((name for name in rows if name in results), None)
    if row is not None:
        params = report["params"]
        tokens = params.get("mean_tokens") or params["max_length"]
        return Throughput(float(results[row]["docs_per_s"]), float(tokens), precision,
                          f"{path} row {row!r}")
    ours = sorted(name for name in results if name.startswith("ours"))
    if ours:
        raise ValueError(f"{path} has no row for precision {precision} (rows: "
                         f"{', '.join(ours)}): pass --precision with one of them")
    raise ValueError(f"{path}: neither a bench/encode.py nor a bench/refresh_scaling.py "
                     "report (no results.ours <precision>.docs_per_s or "
                     "per_replica_docs_per_s)")


def scale_throughput(docs_per_s: float, measured_tokens: float, doc_tokens: float) -> float:
    """Throughput at another document length, assuming cost linear in tokens (the feed-forward
    and projection layers dominate below ~512 tokens; attention's quadratic term is ignored)."""
    return docs_per_s * measured_tokens / doc_tokens


def workload(*, docs: int, dim: int, replicas: int, train_queries: int,
             docs_per_s: float | None = None, measured: Throughput | None = None,
             eval_queries: int = 0, doc_tokens: int = 256, query_tokens: int = 32,
             store_mb_s: float = 200.0, model_params: int | None = None,
             config: RunConfig | None = None, index_type: str | None = None,
             ivf_quantizer: str | None = None, partitions: int | None = None,
             embedding_bytes: int = VECTOR_BYTES, indexer_cpus: int | None = None,
             overlap_build: bool | None = None,
             passages_per_doc: float | None = None) -> Workload:
    """A :class:`Workload`; a run configuration supplies the index settings, shard sizes,
    mining and evaluation depths and caps the token counts at the model's max lengths.
    The encoding rate is ``docs_per_s`` (at the capped ``doc_tokens``) or a ``measured``
    :class:`Throughput`, rescaled to the tokens left after the cap.

    ``passages_per_doc``: mean passages per document after the ``max_passages`` cap, needed
    when the config's ``data.passages.mode`` is max (only the corpus knows it), 1 or None
    otherwise. With MaxP ``doc_tokens`` is the first passage's, capped at the passage
    length, and :attr:`Workload.tokens_per_doc` says what a document costs to encode."""
    extra: dict = {}
    index = config.index if config else IndexConfig()
    passages = config.data.passages if config else PassagesConfig()
    if passages.enabled:
        assert config is not None
        if passages_per_doc is None:
            raise ValueError("data.passages.mode is max: give --passages-per-doc, the mean "
                             "passages per document after the max_passages cap (only the "
                             "corpus knows it; ance-train would have to tokenise it)")
        if not 1 <= passages_per_doc <= passages.max_passages:
            raise ValueError(f"--passages-per-doc {passages_per_doc:g} must lie in [1, "
                             f"{passages.max_passages}] (data.passages.max_passages)")
        length = passages.length or config.model.max_doc_length
        extra = {"maxp": True, "passages_per_doc": float(passages_per_doc),
                 "max_passages": passages.max_passages, "passage_tokens": length}
    elif passages_per_doc is not None and passages_per_doc != 1:
        fix = ("set data.passages.mode max" if config
               else "give a --config with data.passages.mode max")
        raise ValueError(f"--passages-per-doc {passages_per_doc:g} splits documents into "
                         f"passages, but data.passages.mode is first"
                         f"{'' if config else ' (no --config: the default)'}: {fix}, or "
                         "give 1")
    if overlap_build is None:  # the config's (index.build_while_encoding)
        overlap_build = index.build_while_encoding
    if config is not None:
        neg = config.negatives
        extra |= {"shard_size": config.inference.shard_size,
                  "query_shard_size": config.inference.query_shard_size,
                  "mine_depth": max(100, neg.sampling_strategy.depth()),
                  "eval_depth": config.index.eval_depth}
        if partitions is None:
            partitions = config.index.partitions
        # MaxP: the first passage's tokens, at most a passage's.
        doc_tokens = min(doc_tokens, extra.get("passage_tokens", config.model.max_doc_length))
        query_tokens = min(query_tokens, config.model.max_query_length)
    if index_type is not None or ivf_quantizer is not None:
        settings = index.model_dump(exclude_unset=True)
        if index_type is not None:
            settings["type"] = index_type
        if ivf_quantizer is not None:
            settings["ivf"] = {**settings.get("ivf", {}), "quantizer": ivf_quantizer}
        index = IndexConfig.model_validate(settings)
    if (docs_per_s is None) == (measured is None):
        raise ValueError("give the encoding rate once: docs_per_s or a measured throughput")
    rate = ""
    if measured is not None:  # after the cap: the rate of the documents the run encodes
        docs_per_s, rate = measured.at(doc_tokens), measured.describe(doc_tokens)
    assert docs_per_s is not None
    return Workload(docs=docs, dim=dim, replicas=replicas, docs_per_s=docs_per_s, rate=rate,
                    train_queries=train_queries, eval_queries=eval_queries,
                    doc_tokens=doc_tokens, query_tokens=query_tokens, store_mb_s=store_mb_s,
                    model_params=model_params or MINILM_PARAMS, index=index,
                    partitions=partitions or 1, embedding_bytes=embedding_bytes,
                    indexer_cpus=indexer_cpus, overlap_build=overlap_build, **extra)


def firstp_config(config: RunConfig) -> RunConfig:
    """``config`` with ``data.passages.mode: first``: the FirstP baseline of a MaxP plan."""
    return config.model_copy(update={"data": config.data.model_copy(
        update={"passages": PassagesConfig()})})


def passage_cost(load: Workload, result: Plan, base: Workload, base_result: Plan) -> dict:
    """What MaxP costs: ``load``'s plan against ``base``, the same run with FirstP (one
    vector per document), as the vectors and MaxP/FirstP ratios of encode time, index
    memory (one partition), build work (on the refresh or hidden by encoding), store bytes
    per refresh (all but the checkpoint) and search time (training + evaluation queries;
    ``best_passage`` is listed apart). A ratio is None where FirstP's term is 0."""
    def ratio(ours: float, theirs: float) -> float | None:
        return ours / theirs if theirs else None

    def build(plan_: Plan) -> float:
        return plan_.seconds["index_build"] + plan_.hidden_seconds.get("index_build", 0.0)

    def search(plan_: Plan) -> float:
        return plan_.seconds["search_train"] + plan_.seconds["search_eval"]

    def store(plan_: Plan) -> int:
        return plan_.storage_bytes["total"] - plan_.storage_bytes["checkpoint"]

    terms = {"encode_s": (result.seconds["encode"], base_result.seconds["encode"]),
             "index_bytes": (result.index_bytes, base_result.index_bytes),
             "index_build_s": (build(result), build(base_result)),
             "store_bytes_per_refresh": (store(result), store(base_result)),
             "search_s": (search(result), search(base_result)),
             "refresh_s": (result.refresh_s, base_result.refresh_s)}
    return {"passages_per_doc": load.passages_per_doc, "max_passages": load.max_passages,
            "passage_tokens": load.passage_tokens, "tokens_per_doc": load.tokens_per_doc,
            "vectors": load.vectors, "firstp_vectors": base.vectors,
            "search_depth": {"mine": load.depth(load.mine_depth),
                             "eval": load.depth(load.eval_depth)},
            "maxp": {name: ours for name, (ours, _) in terms.items()},
            "firstp": {name: theirs for name, (_, theirs) in terms.items()},
            "ratio": {name: ratio(ours, theirs) for name, (ours, theirs) in terms.items()}}


def describe(load: Workload) -> dict:
    """The workload as JSON-ready values (the MaxP fields and ``vectors`` only with MaxP)."""
    values = {**asdict(load), "index": load.index.model_dump(mode="json")}
    if not load.maxp:
        for name in ("maxp", "passages_per_doc", "max_passages", "passage_tokens"):
            del values[name]
    else:
        values |= {"vectors": load.vectors, "tokens_per_doc": load.tokens_per_doc}
    return values


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


def render(load: Workload, result: Plan, rates: IndexRates,
           passages: dict | None = None) -> str:
    """A plain-text report of a plan; ``passages``: :func:`passage_cost` (MaxP)."""
    quantizer = (f" ({load.index.ivf.quantizer} quantizer)"
                 if load.index.type in ("ivf", "ivfpq") else "")
    cpus = load.indexer_cpus or rates.cpus
    tokens = f"{load.doc_tokens} tokens/doc"
    if load.maxp:  # docs_per_s is at the first passage's tokens
        maxp_rate = load.docs_per_s * load.doc_tokens / load.tokens_per_doc
        tokens = (f"at {tokens}, so {maxp_rate:,.1f} docs/s at {load.tokens_per_doc:,.0f} "
                  f"tokens/doc in {load.passages_per_doc:g} passages")
    lines = [f"{load.docs:,} docs × {load.dim}-d, {load.replicas} replica(s) at "
             f"{load.docs_per_s:,.1f} docs/s each ({tokens}), "
             f"{load.train_queries:,} training + {load.eval_queries:,} eval queries, "
             f"index {load.index.type}{quantizer} in {load.partitions} partition(s) of "
             f"{cpus} cores, {load.embedding_bytes}-byte embedding values"]
    if load.rate:
        lines.append(f"encoding rate: {load.rate}")
    lines += ["", "refresh (checkpoint saved → negatives ready):"]
    for name, seconds in result.seconds.items():
        share = seconds / result.refresh_s if result.refresh_s else 0.0
        lines.append(f"  {name:<20} {_duration(seconds):>10}  {share:6.1%}")
    lines.append(f"  {'total':<20} {_duration(result.refresh_s):>10}")
    if result.hidden_seconds:
        lines.append("  overlapped with encoding: " + ", ".join(
            f"{name} {_duration(seconds)}" for name, seconds in result.hidden_seconds.items()))
    lines += ["", "storage per checkpoint:"]
    lines += [f"  {name:<20} {_size(size):>10}" for name, size in result.storage_bytes.items()]
    lines += ["", "pods: " + ", ".join(f"{role} {count}" for role, count in result.pods.items()),
              f"index memory per partition: {_size(result.index_bytes)}; indexer working set "
              f"beyond the runtime: partition 0 {_size(result.indexer_bytes)}"
              + (f", other partitions {_size(result.partition_bytes)}"
                 if load.partitions > 1 else ""),
              f"index rates: {rates.source} ({rates.cpus} cores, scaled linearly to {cpus})"]
    if passages is not None:
        lines += ["", *_render_passages(passages)]
    return "\n".join(lines)


def _render_passages(cost: dict) -> list[str]:
    """The MaxP section of :func:`render`."""
    depth = cost["search_depth"]
    lines = [f"MaxP: {cost['passages_per_doc']:g} passages/doc (at most "
             f"{cost['max_passages']} of {cost['passage_tokens']} tokens) → "
             f"{cost['vectors']:,} vectors (FirstP: {cost['firstp_vectors']:,}); searches ask "
             f"for {depth['mine']:,} (mining) and {depth['eval']:,} (eval) passages per query",
             f"  {'against FirstP':<24} {'MaxP':>10} {'FirstP':>10} {'ratio':>7}"]
    names = {"encode_s": "encode", "index_bytes": "index memory/partition",
             "index_build_s": "index build", "store_bytes_per_refresh": "store per refresh",
             "search_s": "search (train + eval)", "refresh_s": "refresh"}
    for key, name in names.items():
        show = _size if "bytes" in key else _duration
        ratio = cost["ratio"][key]
        lines.append(f"  {name:<24} {show(cost['maxp'][key]):>10} {show(cost['firstp'][key]):>10} "
                     + (f"{ratio:6.2f}×" if ratio is not None else f"{'-':>7}"))
    return lines


@dataclass(frozen=True)
class StoreNeed:
    """Bytes the embedded run's store will hold at its fullest, by kind (``plan``'s sizes
    per checkpoint times what retention keeps)."""

    parts: dict[str, int]
    checkpoints: int  # checkpoints the run writes
    kept_checkpoints: int
    kept_refreshes: int
    per_checkpoint: int  # weights + Adam state of one checkpoint

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        return ", ".join(f"{name} {_size(size)}" for name, size in self.parts.items())


def run_store_bytes(config: RunConfig, *, docs: int, train_queries: int, eval_queries: int,
                    dim: int, model_params: int, dataset_bytes: int = 0,
                    passages_per_doc: float | None = None) -> StoreNeed:
    """What the run's store needs: every checkpoint (weights + Adam state) and every refresh's
    embeddings, negatives table and partition lists (:func:`plan`'s ``storage_bytes``),
    bounded by ``store.keep_checkpoints`` / ``store.keep_refreshes`` when set. Retention
    keeps more than N at times: the best and the served checkpoint besides the newest N, and
    the refresh the trainer still reads besides the newest N built, so N + 2 checkpoints and
    N + 1 refreshes are counted. ``dataset_bytes``: the dataset copy published to the store.
    With MaxP a refresh's embeddings hold ``passages_per_doc`` rows per document; not given,
    ``data.passages.max_passages`` (the most there can be: a disk check never counts short).
    """
    embedding_bytes = int(np.dtype(config.inference.embedding_dtype).itemsize)
    passages = config.data.passages
    if passages.enabled and passages_per_doc is None:
        passages_per_doc = passages.max_passages
    load = workload(docs=docs, dim=dim, replicas=1, docs_per_s=1.0,
                    train_queries=train_queries, eval_queries=eval_queries,
                    model_params=model_params, config=config, embedding_bytes=embedding_bytes,
                    passages_per_doc=passages_per_doc)
    per = plan(load).storage_bytes
    checkpoints = len(config.training.checkpoint_steps())  # the trainer's own rule
    keep_c, keep_r = config.store.keep_checkpoints, config.store.keep_refreshes
    kept_c = checkpoints if keep_c is None else min(checkpoints, keep_c + 2)
    kept_r = checkpoints if keep_r is None else min(checkpoints, keep_r + 1)
    parts = {"checkpoints": kept_c * per["checkpoint"],
             "refreshes": kept_r * (per["total"] - per["checkpoint"])}
    if dataset_bytes:
        parts["dataset"] = dataset_bytes
    return StoreNeed(parts={k: int(v) for k, v in parts.items()}, checkpoints=checkpoints,
                     kept_checkpoints=kept_c, kept_refreshes=kept_r,
                     per_checkpoint=int(per["checkpoint"]))


def encoder_size(path: str | Path, projection_dim: int | None = None) -> tuple[int, int]:
    """(parameters, embedding dimension) of a Hugging Face encoder directory, read from its
    ``config.json`` and its weight files' headers (nothing is loaded); a projection head
    (``model.projection_dim``) adds hidden × dim + dim weights and a LayerNorm."""
    from safetensors import safe_open

    path = Path(path)
    hidden = int(json.loads((path / "config.json").read_text())["hidden_size"])
    params = 0
    files = sorted(path.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="numpy") as weights:
            for name in weights.keys():  # noqa: SIM118 - safe_open is not a mapping
                params += math.prod(weights.get_slice(name).get_shape())
    if not files:  # a PyTorch pickle: its size in float32 words bounds the count
        params = sum(f.stat().st_size for f in path.glob("*.bin")) // VECTOR_BYTES
    if projection_dim:
        params += hidden * projection_dim + 3 * projection_dim
    return params, projection_dim or hidden
