"""The FAISS index over one checkpoint's corpus embeddings (inner product).

``index.type`` picks the structure: ``flat`` (``IndexFlatIP``, exact, as in ANCE §5, so the
mined negatives are the true top-K of the checkpoint), ``ivf``, ``ivfpq`` or ``hnsw``
(approximate; their recall against flat is in docs/benchmarks/indexer.md). The indexer
searches the embeddings of a checkpoint as they are: a ``similarity: cosine`` model already
returns unit vectors (:meth:`BiEncoder.forward` normalises them, the one place that does), so
inner product is cosine. ``AnnIndex(..., similarity="cosine")`` L2-normalises vectors and
queries itself, for raw vectors that did not come from the model (benchmarks, tests).

Memory stays bounded by the index: searches run in batches of ``index.search_batch_size``
queries (FAISS itself scores a batch in blocks), exact candidate scores are computed a few
rows at a time, and IVF types are trained on the first ``nlist × train_points_per_list``
vectors received, then fed shard by shard. Shards arrive in corpus order, so a corpus
sorted by topic should be shuffled before using ``ivf``/``ivfpq``.
"""

from __future__ import annotations

import functools
import logging
import subprocess
import sys
from collections.abc import Callable

import faiss
import numpy as np

from ance_train.config import IndexConfig
from ance_train.index.capacity import (
    HNSW_QUANTIZER_M,
    MIN_POINTS_PER_LIST,
    ivf_lists,
    ivf_train_size,
    pq_m,
)
from ance_train.index.merge import canonical_order

log = logging.getLogger(__name__)

SCORE_BLOCK_BYTES = 64 << 20  # candidate vectors gathered at once by ``AnnIndex.scores``
GPU_MAX_K = 2048  # the deepest search FAISS runs on a GPU (the tie look-ahead stops there)


def faiss_gpus() -> int:
    """GPUs FAISS can use (0 with ``faiss-cpu``)."""
    return faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0


# One exact search on GPU 0, in a child process: a FAISS build without code for the GPU's
# architecture fails a C++ assertion at its first kernel and aborts the whole process (seen:
# faiss-gpu-cu12 1.14.1, built for sm_70 and sm_80 only, on an H200: "CUDA error 209 no kernel
# image is available for execution on the device").
GPU_PROBE = """
import faiss, numpy as np
index = faiss.GpuIndexFlatIP(faiss.StandardGpuResources(), 8)
index.add(np.eye(8, dtype="float32"))
assert index.search(np.eye(8, dtype="float32"), 1)[1].ravel().tolist() == list(range(8))
"""
GPU_PROBE_TIMEOUT_S = 120


@functools.cache
def gpu_probe_error() -> str | None:
    """Why FAISS cannot search on the GPU (the probe's first stderr line naming an error, else
    its last line), or None if it can.
    Run once per process."""
    try:
        done = subprocess.run([sys.executable, "-c", GPU_PROBE], capture_output=True,
                              text=True, timeout=GPU_PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return f"a one-vector GPU search did not finish in {GPU_PROBE_TIMEOUT_S} s"
    if done.returncode == 0:
        return None
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    cause = next((line for line in lines if "error" in line.lower()), None)
    return (cause or (lines[-1] if lines else f"exit status {done.returncode}"))[:400]


def use_gpu(device: str) -> bool:
    """Resolve ``index.device``. ``gpu`` where FAISS sees no GPU, or cannot run on it, is a
    configuration error; ``auto`` then uses the CPU (with a warning in the second case)."""
    if device == "cpu":
        return False
    gpus = faiss_gpus()
    if gpus == 0:
        if device == "gpu":
            raise ValueError("index.device is gpu but FAISS sees no GPU (faiss-cpu installed, "
                             "or no CUDA device): use auto or cpu")
        return False
    error = gpu_probe_error()
    if error is None:
        return True
    if device == "gpu":
        raise ValueError(f"index.device is gpu but FAISS cannot search on this GPU ({error}): "
                         "install a FAISS build with code for its architecture (the gpu "
                         "extra's faiss-gpu), or use auto or cpu")
    _warn_auto_stays_on_cpu(gpus, error)
    return False


@functools.cache
def _warn_auto_stays_on_cpu(gpus: int, error: str) -> None:
    """Once per process, not at every refresh's index."""
    log.warning("index.device auto: FAISS sees %d GPU(s) but cannot search on them (%s); "
                "the index stays on the CPU", gpus, error)


def _new_index(config: IndexConfig, dim: int, nlist: int) -> faiss.Index:
    ip = faiss.METRIC_INNER_PRODUCT
    if config.type == "flat":
        return faiss.IndexFlatIP(dim)
    if config.type == "hnsw":
        graph = faiss.IndexHNSWFlat(dim, config.hnsw.m, ip)
        graph.hnsw.efConstruction = config.hnsw.ef_construction
        return graph
    quantizer: faiss.Index
    if config.ivf.quantizer == "hnsw":
        quantizer = graph = faiss.IndexHNSWFlat(dim, HNSW_QUANTIZER_M, ip)
        graph.hnsw.efSearch = config.ivf.quantizer_ef_search
    else:
        quantizer = faiss.IndexFlatIP(dim)
    index: faiss.IndexIVF
    if config.type == "ivf":
        index = faiss.IndexIVFFlat(quantizer, dim, nlist, ip)
    else:
        index = faiss.IndexIVFPQ(quantizer, dim, nlist, pq_m(config, dim), config.pq.nbits, ip)
    if config.ivf.quantizer == "hnsw":
        # k-means on a flat index, then the centroids are added to the graph (what FAISS's
        # index_factory sets up for "IVF<n>_HNSW<m>"). ignore: FAISS's stub types this C++
        # char as str; SWIG takes the number.
        index.quantizer_trains_alone = 2  # type: ignore[assignment]
    return index  # the FAISS Python wrapper keeps ``quantizer`` alive with the index


def blockwise_scores(vectors: Callable[[np.ndarray], np.ndarray], dim: int,
                     queries: np.ndarray, doc_ids: np.ndarray) -> np.ndarray:
    """Inner product of each query row with ``vectors(doc_ids row)``, ``[Q, K]``, gathering at
    most ``SCORE_BLOCK_BYTES`` of document vectors at a time (never all candidates at once)."""
    out = np.zeros(doc_ids.shape, dtype=np.float32)
    step = max(1, SCORE_BLOCK_BYTES // max(1, doc_ids.shape[1] * dim * 4))
    for start in range(0, len(doc_ids), step):
        block = vectors(doc_ids[start:start + step])
        out[start:start + step] = np.einsum("qd,qkd->qk", queries[start:start + step], block)
    return out


def recall_at(found: np.ndarray, exact: np.ndarray, k: int) -> float:
    """Mean share of each row's exact top-``k`` that ``found``'s top-``k`` contains."""
    hits = [len(np.intersect1d(f[:k], e[:k][e[:k] >= 0])) / max(1, int((e[:k] >= 0).sum()))
            for f, e in zip(found, exact, strict=True)]
    return float(np.mean(hits)) if hits else 0.0


class AnnIndex:
    """Document embeddings of one checkpoint, searchable by inner product.

    ``add`` shards (document indices + vectors), then ``finalize``, then ``search`` /
    ``vectors`` / ``scores``. ``expected_size`` (the corpus size) sets the IVF defaults and
    lets IVF training start before every shard is in.
    """

    def __init__(self, dim: int, config: IndexConfig | None = None, similarity: str = "dot",
                 expected_size: int | None = None) -> None:
        self.dim = dim
        self.config = config or IndexConfig()
        self.normalize = similarity == "cosine"
        self.expected_size = expected_size
        self.gpu = use_gpu(self.config.device)
        # FAISS has no GPU HNSW, neither as the index nor as an IVF coarse quantizer.
        self.cpu_only = (self.config.type == "hnsw"
                         or (self.config.type in ("ivf", "ivfpq")
                             and self.config.ivf.quantizer == "hnsw"))
        if self.config.type == "ivfpq":
            pq_m(self.config, dim)  # fail before any data is read
        self.index: faiss.Index | None = None
        self._search_index: faiss.Index | None = None
        self._pending: list[np.ndarray] = []  # IVF: vectors waiting for training
        self._pending_count = 0
        self._doc_ids: list[np.ndarray] = []
        self.nlist: int | None = None
        if self.config.type in ("flat", "hnsw"):
            self.index = _new_index(self.config, dim, 0)

    # -- building ---------------------------------------------------------------------------
    def _prepared(self, vectors: np.ndarray) -> np.ndarray:
        """float32, C-contiguous, L2-normalised for cosine (never modifies the caller's array)."""
        if not self.normalize:
            return np.ascontiguousarray(vectors, dtype=np.float32)
        out = np.array(vectors, dtype=np.float32, order="C")
        faiss.normalize_L2(out)
        return out

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        if vectors.ndim != 2 or vectors.shape[1] != self.dim:
            raise ValueError(
                f"embedding dimension {vectors.shape[1]} != index dimension {self.dim}"
            )
        vectors = self._prepared(vectors)
        self._doc_ids.append(np.asarray(ids, dtype=np.int64))
        if self.index is not None:
            self.index.add(vectors)
            return
        self._pending.append(vectors)
        self._pending_count += len(vectors)
        if (self.expected_size
                and self._pending_count >= ivf_train_size(self.config, self.expected_size)):
            self._train()

    def _train(self) -> None:
        """Train the IVF index on the pending vectors, then add them (and free them)."""
        count = self._pending_count
        total = max(self.expected_size or 0, count)
        # ``ivf_train_size`` vectors give every list ≥ 39 points; the min guards odd callers.
        self.nlist = max(1, min(ivf_lists(self.config, total), count // MIN_POINTS_PER_LIST))
        if self.config.ivf.nlist and self.nlist < self.config.ivf.nlist:
            log.warning("index.ivf.nlist lowered from %d to %d: only %d training vectors",
                        self.config.ivf.nlist, self.nlist, count)
        if self.config.type == "ivfpq" and count < 2 ** self.config.pq.nbits:
            raise ValueError(f"index.type ivfpq needs at least 2^index.pq.nbits = "
                             f"{2 ** self.config.pq.nbits} vectors to train, got {count}")
        index = _new_index(self.config, self.dim, self.nlist)
        wanted_rows, parts, taken = ivf_train_size(self.config, total), [], 0
        for part in self._pending:
            if taken >= wanted_rows:
                break
            parts.append(part[: wanted_rows - taken])
            taken += len(parts[-1])
        sample = np.concatenate(parts)
        del parts
        index.train(sample)
        del sample
        while self._pending:
            index.add(self._pending.pop(0))
        self._pending_count = 0
        self.index = index

    def finalize(self) -> None:
        """Finish building: train IVF if not yet done, map rows to documents, move to GPU."""
        if self.index is None:
            if not self._pending:
                self.index = faiss.IndexFlatIP(self.dim)  # empty: nothing to train
            else:
                self._train()
        assert self.index is not None
        # Row ↔ document map, kept here rather than in FAISS's IndexIDMap2. IndexIDMap2 works
        # (add_with_ids over flat/ivf/ivfpq/hnsw on the CPU gives the same ids and scores, and
        # FAISS's cloner moves its sub-index to the GPU), but ``vectors`` needs the document →
        # row direction, which IndexIDMap2 keeps in a std::unordered_map: ~52 bytes per
        # document for its two maps (measured, faiss 1.15, 2M ids) against 8 here (24 when
        # shards come out of order). On an ivfpq index of 768-d embeddings (112 bytes per
        # document), the type chosen to save memory, that is ~40 % more, and
        # capacity.index_bytes (ID_BYTES per document) would no longer predict it.
        self._row_to_doc = (np.concatenate(self._doc_ids) if self._doc_ids
                            else np.zeros(0, np.int64))
        self._doc_ids = []
        # Shards arrive in corpus order, so rows are usually sorted by document already: then
        # row ↔ document needs no second array (8 bytes per document in all).
        if np.all(self._row_to_doc[1:] > self._row_to_doc[:-1]):
            self._by_doc: np.ndarray | None = None
            self._sorted_docs = self._row_to_doc
        else:
            self._by_doc = np.argsort(self._row_to_doc, kind="stable")
            self._sorted_docs = self._row_to_doc[self._by_doc]
        if isinstance(self.index, faiss.IndexIVF):
            self.index.make_direct_map()  # for ``vectors``: reconstruct by row
            faiss.ParameterSpace().set_index_parameter(
                self.index, "nprobe", min(self.config.ivf.nprobe, self.index.nlist))
        self._search_index = self.index
        self._on_gpu = self.gpu and not self.cpu_only
        if self._on_gpu:  # FAISS has no GPU HNSW (as the index or the IVF quantizer)
            self._search_index = faiss.index_cpu_to_all_gpus(self.index)
            if isinstance(self.index, faiss.IndexIVF):
                faiss.GpuParameterSpace().set_index_parameter(
                    self._search_index, "nprobe", min(self.config.ivf.nprobe, self.index.nlist))

    # -- reading ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return 0 if self.index is None else int(self.index.ntotal)

    def rows(self, doc_ids: np.ndarray) -> np.ndarray:
        """Index rows of ``doc_ids`` (KeyError for a document not in the index)."""
        flat = np.asarray(doc_ids, dtype=np.int64).ravel()
        if len(self._sorted_docs) == 0:
            if len(flat):
                raise KeyError(f"documents not in the index: {flat[:5].tolist()}")
            return flat
        pos = np.minimum(np.searchsorted(self._sorted_docs, flat), len(self._sorted_docs) - 1)
        found = self._sorted_docs[pos] == flat
        if not found.all():
            raise KeyError(f"documents not in the index: {flat[~found][:5].tolist()}")
        return pos if self._by_doc is None else self._by_doc[pos]

    def present(self, doc_ids: np.ndarray) -> np.ndarray:
        """Whether each of ``doc_ids`` (row keys: documents, or passages with MaxP) is in the
        index."""
        flat = np.asarray(doc_ids, dtype=np.int64).ravel()
        if len(self._sorted_docs) == 0:
            return np.zeros(len(flat), dtype=bool)
        pos = np.minimum(np.searchsorted(self._sorted_docs, flat), len(self._sorted_docs) - 1)
        return self._sorted_docs[pos] == flat

    def best_vectors(self, queries: np.ndarray, doc_ids: np.ndarray) -> np.ndarray:
        """The vector each query (row) is compared with for its document ``doc_ids[i]``: the
        document's one vector (:class:`~ance_train.index.passages.PassageIndex` picks the
        best passage's)."""
        return self.vectors(doc_ids)

    def vectors(self, doc_ids: np.ndarray) -> np.ndarray:
        """The stored embeddings of ``doc_ids`` (document indices, not index rows); with
        ``ivfpq`` these are the PQ reconstructions."""
        assert self.index is not None
        rows = self.rows(doc_ids)
        out = self.index.reconstruct_batch(rows) if len(rows) else np.zeros((0, self.dim))
        return out.astype(np.float32, copy=False).reshape(*np.shape(doc_ids), self.dim)

    def scores(self, queries: np.ndarray, doc_ids: np.ndarray) -> np.ndarray:
        """Inner product of each query row with the stored vectors of its ``doc_ids`` row
        (``[Q, K]``)."""
        return blockwise_scores(self.vectors, self.dim, queries, doc_ids)

    def search(self, queries: np.ndarray, k: int, batch_size: int = 1024,
               cancel: Callable[[], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` document indices and scores per query (``-1`` where fewer exist), in
        batches of ``batch_size`` queries. ``cancel`` is called before each batch and may
        raise to abandon the search (the indexer's supersession check).

        Each row is in :func:`canonical_order`, and where documents tie in score across the
        cut-off at ``k`` the lowest document indices are kept: FAISS keeps an arbitrary
        subset of such a tie, so the batch is searched one deeper, and deeper again (the
        same queries together, so their scores are the same bits) while a tie crosses the
        cut. Then merged partitions rank exactly as one flat index does (index/merge.py).
        """
        assert self._search_index is not None, "finalize() the index before searching"
        k = min(k, len(self))
        all_ids = np.full((len(queries), k), -1, dtype=np.int64)
        all_scores = np.zeros((len(queries), k), dtype=np.float32)
        if k == 0:
            return all_ids, all_scores
        for start in range(0, len(queries), batch_size):
            if cancel is not None:
                cancel()
            chunk = self._prepared(queries[start : start + batch_size])
            deepest = max(k, min(len(self), GPU_MAX_K if self._on_gpu else len(self)))
            depth = min(k + 1, deepest)
            while True:
                ids, scores = canonical_order(*self._search_rows(chunk, depth))
                if depth in (k, deepest):
                    break
                crossing = (ids[:, depth - 1] >= 0) & (scores[:, depth - 1] == scores[:, k - 1])
                if not crossing.any():
                    break
                depth = min(2 * depth, deepest)
            all_ids[start : start + len(chunk)] = ids[:, :k]
            all_scores[start : start + len(chunk)] = scores[:, :k]
        return all_ids, all_scores

    def _search_rows(self, chunk: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
        """One FAISS search: document indices (``-1`` for none) and scores."""
        assert self._search_index is not None
        params = None
        if self.config.type == "hnsw":  # per call: concurrent searches may differ in k
            # ignore: FAISS's stub (1.15) lacks SearchParametersHNSW, which the module has.
            params = faiss.SearchParametersHNSW(  # type: ignore[attr-defined]
                efSearch=max(self.config.hnsw.ef_search, depth))
        scores, rows = self._search_index.search(chunk, depth, params=params)
        return np.where(rows >= 0, self._row_to_doc[np.maximum(rows, 0)], -1), scores

    def nbytes(self) -> int:
        """Size of the FAISS index as serialised (≈ its memory; a measurement, not a model)."""
        assert self.index is not None
        return int(faiss.serialize_index(self.index).nbytes)
