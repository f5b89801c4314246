"""Index types of src/ance_train/index/ann.py (flat, ivf, ivfpq, hnsw) on clustered data: shapes,
recall against flat, batched search, cosine, exact candidate scores, and configuration errors."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from ance_train.config import ConfigError, IndexConfig, parse_config
from ance_train.index import ann
from ance_train.index.ann import AnnIndex, recall_at

from ance_train_dev.synthetic import clustered_vectors, queries_near

DIM = 32
DOCS = 6000
SHARD = 1000
# Recall@10 against flat on the clustered data below must stay above these floors (measured
# here: ivf 1.0, hnsw 1.0, ivfpq ≈ 0.5 with 4-byte codes). "+hnswq": the IVF type with an HNSW
# coarse quantizer (index.ivf.quantizer: hnsw), held to its flat-quantizer floor.
RECALL_FLOOR = {"flat": 1.0, "ivf": 0.9, "hnsw": 0.9, "ivfpq": 0.35, "ivf+hnswq": 0.9,
                "ivfpq+hnswq": 0.35}
TYPES = ["flat", "ivf", "ivfpq", "hnsw", "ivf+hnswq", "ivfpq+hnswq"]


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    vectors = clustered_vectors(DOCS, DIM, clusters=60, rng=rng, spread=0.8)
    queries, _ = queries_near(vectors, 200, rng)
    ids = rng.permutation(3 * DOCS)[:DOCS].astype(np.int64)  # not row numbers
    return ids, vectors, queries


def _config(kind: str) -> IndexConfig:
    kind, _, quantizer = kind.partition("+")
    extra: dict = {"ivfpq": {"pq": {"m": 4}}}.get(kind, {})
    if quantizer:
        extra["ivf"] = {"quantizer": "hnsw"}
    return IndexConfig.model_validate({"type": kind, "device": "cpu", **extra})


def _build(kind: str, ids: np.ndarray, vectors: np.ndarray, similarity: str = "cosine",
           expected: int | None = DOCS) -> AnnIndex:
    index = AnnIndex(DIM, _config(kind), similarity, expected_size=expected)
    for start in range(0, len(ids), SHARD):
        index.add(ids[start:start + SHARD], vectors[start:start + SHARD])
    index.finalize()
    return index


@pytest.fixture(scope="module")
def built(data) -> dict[str, AnnIndex]:
    """One index of each type over ``data``, built once for the module."""
    ids, vectors, _ = data
    return {kind: _build(kind, ids, vectors) for kind in TYPES}


@pytest.fixture(scope="module")
def flat_top(data, built) -> np.ndarray:
    return built["flat"].search(data[2], 10)[0]


@pytest.mark.parametrize("kind", TYPES)
def test_each_type_returns_top_k_with_recall(kind: str, data, built, flat_top) -> None:
    ids, _, queries = data
    index = built[kind]
    assert len(index) == DOCS
    got, scores = index.search(queries, 10)
    assert got.shape == (200, 10) and got.dtype == np.int64 and scores.dtype == np.float32
    assert set(got.ravel().tolist()) <= set(ids.tolist())
    assert np.all(np.diff(scores, axis=1) <= 1e-5)  # best first
    assert recall_at(got, flat_top, 10) >= RECALL_FLOOR[kind]


@pytest.mark.parametrize("kind", TYPES)
def test_batched_search_equals_one_batch(kind: str, data, built) -> None:
    index, queries = built[kind], data[2]
    whole_ids, whole_scores = index.search(queries, 25, batch_size=len(queries))
    for batch_size in (1, 7, 64):
        part_ids, part_scores = index.search(queries, 25, batch_size=batch_size)
        assert np.array_equal(part_ids, whole_ids), (kind, batch_size)
        assert np.allclose(part_scores, whole_scores, atol=1e-5), (kind, batch_size)


def test_ivf_trains_early_on_a_sample_and_keeps_every_shard(data) -> None:
    ids, vectors, _ = data
    index = AnnIndex(DIM, _config("ivf"), "cosine", expected_size=DOCS)
    index.add(ids[:SHARD], vectors[:SHARD])
    assert index.index is None  # 1000 < nlist × 39: still waiting for training vectors
    for start in range(SHARD, DOCS, SHARD):
        index.add(ids[start:start + SHARD], vectors[start:start + SHARD])
    assert index.index is not None and index.index.is_trained
    # nlist = round(4·sqrt(6000)) = 310 would need 12,090 training vectors: lowered to 6000/39.
    assert index.nlist == DOCS // ann.MIN_POINTS_PER_LIST
    index.finalize()
    assert len(index) == DOCS
    # The direct map makes stored vectors readable by document id (exact for ivf).
    normalised = vectors[:5] / np.linalg.norm(vectors[:5], axis=1, keepdims=True)
    assert np.allclose(index.vectors(ids[:5]), normalised, atol=1e-6)


def test_cosine_normalises_vectors_and_queries(data) -> None:
    ids, vectors, queries = data
    scale = np.random.default_rng(1).uniform(0.5, 3.0, size=(DOCS, 1)).astype(np.float32)
    cosine = _build("flat", ids, vectors * scale, similarity="cosine")
    dot = _build("flat", ids, vectors * scale, similarity="dot")
    got_ids, got_scores = cosine.search(queries * 4.0, 10)
    want_ids, want_scores = _build("flat", ids, vectors).search(queries, 10)
    assert np.array_equal(got_ids, want_ids)
    assert np.allclose(got_scores, want_scores, atol=1e-5)
    assert not np.array_equal(dot.search(queries, 10)[0], want_ids)  # dot keeps the norms
    assert np.allclose(np.linalg.norm(vectors[:3] * scale[:3], axis=1),
                       np.linalg.norm(dot.vectors(ids[:3]), axis=1), rtol=1e-5)


def test_scores_in_blocks_equal_einsum(data, built, monkeypatch: pytest.MonkeyPatch) -> None:
    index, queries = built["flat"], data[2]
    candidates = index.search(queries, 30)[0]
    want = np.einsum("qd,qkd->qk", queries, index.vectors(candidates))
    monkeypatch.setattr(ann, "SCORE_BLOCK_BYTES", 30 * DIM * 4 * 3)  # three rows per block
    assert np.allclose(index.scores(queries, candidates), want, atol=1e-5)


def test_unknown_document_is_a_key_error(data) -> None:
    ids, vectors, _ = data
    index = _build("flat", ids[:100], vectors[:100], expected=None)
    missing = np.setdiff1d(np.arange(3 * DOCS), ids[:100])[:2]
    with pytest.raises(KeyError, match=str(missing[0])):
        index.vectors(missing)


def test_recall_at_counts_the_exact_top_k() -> None:
    exact = np.array([[1, 2, 3, 4], [5, 6, -1, -1]])
    found = np.array([[2, 9, 1, 4], [6, 7, 8, 5]])
    assert recall_at(found, exact, 2) == pytest.approx((0.5 + 0.5) / 2)
    assert recall_at(found, exact, 4) == pytest.approx((3 / 4 + 2 / 2) / 2)


def test_ivfpq_memory_is_a_fraction_of_flat(built) -> None:
    flat, pq = built["flat"], built["ivfpq"]
    assert flat.nbytes() >= DOCS * DIM * 4
    assert pq.nbytes() < flat.nbytes() / 3  # 4-byte codes + ids + centroids vs 128-byte rows


def _config_error(index: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config({"data": {"path": "d"}, "index": index})
    return str(info.value)


def test_config_errors_name_the_field() -> None:
    assert "index.type" in _config_error({"type": "annoy"})
    assert "index.device" in _config_error({"device": "tpu"})
    assert "index.ivf.nprobe" in _config_error({"type": "ivf", "ivf": {"nlist": 8, "nprobe": 9}})
    assert "index.hnsw is set but index.type is flat" in _config_error({"hnsw": {"m": 16}})
    assert "index.pq" in _config_error({"type": "ivf", "pq": {"m": 8}})
    assert "index.pq.nbits" in _config_error({"type": "ivfpq", "pq": {"nbits": 20}})
    # A dumped configuration (every section at its default) loads again.
    dumped = parse_config({"data": {"path": "d"}}).model_dump(mode="json")
    assert parse_config(dumped).index == IndexConfig()
    cfg = parse_config({"data": {"path": "d"}, "index": {"type": "ivfpq", "pq": {"m": 5}}})
    with pytest.raises(ValueError, match=r"index.pq.m \(5\) must divide .* 32"):
        AnnIndex(DIM, cfg.index)


def test_hnsw_quantizer_is_a_graph_over_the_centroids(built) -> None:
    for kind in ("ivf", "ivfpq"):
        graph, flat = built[f"{kind}+hnswq"].index, built[kind].index
        quantizer = faiss.downcast_index(graph.quantizer)
        assert isinstance(quantizer, faiss.IndexHNSWFlat)
        assert quantizer.ntotal == graph.nlist == flat.nlist
        assert quantizer.hnsw.efSearch == IndexConfig().ivf.quantizer_ef_search
        assert isinstance(faiss.downcast_index(flat.quantizer), faiss.IndexFlatIP)
    assert "index.ivf.quantizer_ef_search" in _config_error(
        {"type": "ivf", "ivf": {"quantizer": "hnsw", "nprobe": 64, "quantizer_ef_search": 32}})
    assert "index.ivf.quantizer" in _config_error({"type": "ivf", "ivf": {"quantizer": "pq"}})


def test_device_gpu_needs_a_faiss_gpu() -> None:
    config = IndexConfig(device="gpu")
    if ann.faiss_gpus() == 0:
        with pytest.raises(ValueError, match=r"index\.device is gpu"):
            AnnIndex(DIM, config)
        assert AnnIndex(DIM, IndexConfig(device="auto")).gpu is False
    else:
        assert AnnIndex(DIM, config).gpu is True


@pytest.fixture
def one_gpu_seen(monkeypatch: pytest.MonkeyPatch):
    """FAISS reporting one GPU. A stand-in: this machine has none, and what is tested is how
    ``use_gpu`` reads the probe; the probe itself runs as a real child process."""
    monkeypatch.setattr(ann, "faiss_gpus", lambda: 1)
    ann.gpu_probe_error.cache_clear()
    ann._warn_auto_stays_on_cpu.cache_clear()
    yield
    ann.gpu_probe_error.cache_clear()
    ann._warn_auto_stays_on_cpu.cache_clear()


ABORTING_PROBE = """
import os, sys
sys.stderr.write("Faiss assertion 'err__ == cudaSuccess' failed; details: CUDA error 209 "
                 "no kernel image is available for execution on the device\\n")
sys.stderr.flush()
os.abort()
"""


def test_a_gpu_faiss_cannot_run_on_is_refused_for_gpu_and_skipped_for_auto(
        one_gpu_seen, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(ann, "GPU_PROBE", ABORTING_PROBE)
    with pytest.raises(ValueError, match=r"index\.device is gpu .*no kernel image"):
        ann.use_gpu("gpu")
    with caplog.at_level("WARNING", logger="ance_train.index.ann"):
        assert AnnIndex(DIM, IndexConfig(device="auto")).gpu is False
    assert "cannot search on them" in caplog.text and "CUDA error 209" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="ance_train.index.ann"):
        assert AnnIndex(DIM, IndexConfig(device="auto")).gpu is False
    assert "cannot search" not in caplog.text  # said once per process, not per refresh
    assert ann.use_gpu("cpu") is False


def test_the_gpu_probe_runs_once_and_a_passing_probe_uses_the_gpu(
        one_gpu_seen, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    runs = tmp_path / "runs"
    monkeypatch.setattr(ann, "GPU_PROBE", f"open({str(runs)!r}, 'a').write('x')")
    assert ann.use_gpu("auto") is True and ann.use_gpu("gpu") is True
    assert runs.read_text() == "x"
