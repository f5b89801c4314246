"""The arithmetic of ``ance-train plan`` (src/ance_train/index/capacity.py) on known inputs, and its
index-memory model against real FAISS indexes."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ance_train.cli import app
from ance_train.config import IndexConfig, PqConfig, parse_config
from ance_train.index import capacity
from ance_train.index.ann import AnnIndex
from ance_train.index.capacity import IndexRates, Workload, index_bytes, index_work, plan

from ance_train_dev.synthetic import clustered_vectors

RATES = IndexRates({key: 1e9 for key in capacity.DEFAULT_RATES} | {"mine": 1e6}, "test")


def test_refresh_period_of_a_known_workload() -> None:
    load = Workload(docs=10_000, dim=100, replicas=3, docs_per_s=50.0, train_queries=1000,
                    eval_queries=1000, doc_tokens=200, query_tokens=20, shard_size=1000,
                    query_shard_size=2000, mine_depth=100, eval_depth=1000, store_mb_s=100.0,
                    model_params=1_000_000)
    result = plan(load, RATES)
    s = result.seconds
    # 10 corpus shards of 20 s on 3 replicas: 4 waves; one query shard of 2000 queries at
    # 50 × 200/20 = 500 queries/s: 4 s.
    assert s["encode"] == pytest.approx(4 * 20 + 4)
    # Weights 4 MB; checkpoint = weights + Adam state = 12 MB; + 4 MB downloaded = 16 MB.
    assert s["checkpoint_transfer"] == pytest.approx(16e6 / 100e6)
    row = 100 * 4 + 8
    assert result.storage_bytes["embeddings"] == 12_000 * row
    assert s["embedding_transfer"] == pytest.approx((12_000 + 1000) * row / 100e6)
    assert s["index_build"] == pytest.approx(10_000 * 100 / 1e9)  # flat: a copy
    assert s["search_train"] == pytest.approx(1000 * 10_000 * 100 / 1e9)
    assert s["search_eval"] == pytest.approx(1000 * 10_000 * 100 / 1e9)
    assert s["mine"] == pytest.approx(1000 * 100 / 1e6)
    negatives = 1000 * 100 * capacity.NEGATIVE_CELL_BYTES
    assert s["negatives_upload"] == pytest.approx(negatives / 100e6)
    assert result.refresh_s == pytest.approx(sum(s.values()))
    assert result.storage_bytes == {"checkpoint": 12_000_000, "embeddings": 12_000 * row,
                                    "negatives": negatives,
                                    "total": 12_000_000 + 12_000 * row + negatives}
    assert result.index_bytes == 10_000 * (100 * 4 + 8)  # vectors + row → document map
    # Two indexes (one serving, one building) and the larger of the build's buffers (a shard
    # as stored and as float32) and the search's (the query matrix, the training and
    # evaluation results); partition 0 (the only one) also two tables.
    results = (1000 * 100 + 1000 * 1000) * 12
    building = 1000 * (100 * (4 + 4) + 8)
    assert building < 2000 * 100 * 4 + results
    assert result.partition_bytes == 2 * result.index_bytes + 2000 * 100 * 4 + results
    assert result.indexer_bytes == result.partition_bytes + 2 * negatives
    assert result.pods == {"inferencer": 3, "indexer": 1}
    assert "merge" not in s and "partial_results" not in result.storage_bytes


def test_more_replicas_shorten_only_the_encoding() -> None:
    base = dict(docs=100_000, dim=64, docs_per_s=100.0, train_queries=500)
    one, four = (plan(Workload(replicas=r, **base), RATES) for r in (1, 4))
    assert one.seconds["encode"] == pytest.approx(4 * four.seconds["encode"], rel=0.01)
    assert {k: v for k, v in one.seconds.items() if k != "encode"} == {
        k: v for k, v in four.seconds.items() if k != "encode"}


def test_partitions_split_the_index_and_add_a_merge() -> None:
    base = dict(docs=1_000_000, dim=64, replicas=4, docs_per_s=100.0, train_queries=10_000,
                eval_queries=500, mine_depth=200, eval_depth=100, store_mb_s=100.0)
    one, four = plan(Workload(**base), RATES), plan(Workload(partitions=4, **base), RATES)
    assert four.pods == {"inferencer": 4, "indexer": 4}
    assert four.index_bytes == index_bytes(IndexConfig(), 250_000, 64)
    # Flat search is linear in the documents: each partition searches a quarter.
    assert four.seconds["search_train"] == pytest.approx(one.seconds["search_train"] / 4)
    assert four.seconds["index_build"] == pytest.approx(one.seconds["index_build"] / 4)
    results = (10_000 * 200 + 500 * 100) * capacity.RESULT_CELL_BYTES
    assert four.seconds["partial_transfer"] == pytest.approx(5 * results / 100e6)
    assert four.seconds["merge"] == pytest.approx(4 * results / 12 / RATES.rates["merge"])
    assert four.seconds["mine"] == one.seconds["mine"]  # once, on the merged lists
    assert four.storage_bytes["partial_results"] == 4 * results
    # Partition 0 holds the other partitions' lists while merging, the merged ones, and the
    # corpus shards it reads vectors back from (4 shards of the default 1000, float32).
    assert four.indexer_bytes - four.partition_bytes == 3 * results + 2 * (
        10_000 * 200 * capacity.NEGATIVE_CELL_BYTES) + results + 4 * 1000 * (64 * 4 + 8)
    # A partition packs its lists to store them: two more copies than one indexer holds.
    assert four.partition_bytes == 2 * four.index_bytes + 10_500 * 64 * 4 + 3 * results
    assert four.partition_bytes < one.partition_bytes / 2


def test_float16_embeddings_halve_the_vector_bytes() -> None:
    base = dict(docs=10_000, dim=128, replicas=1, docs_per_s=100.0, train_queries=100)
    fp32, fp16 = (plan(Workload(embedding_bytes=b, **base), RATES) for b in (4, 2))
    assert fp32.storage_bytes["embeddings"] == 10_100 * (128 * 4 + 8)
    assert fp16.storage_bytes["embeddings"] == 10_100 * (128 * 2 + 8)
    assert fp16.index_bytes == fp32.index_bytes  # FAISS holds float32 either way


def test_overlapped_build_leaves_only_what_encoding_does_not_hide() -> None:
    base = dict(docs=100_000, dim=64, replicas=1, docs_per_s=1000.0, train_queries=100,
                shard_size=1000, index=IndexConfig(type="ivf"))
    slow = RATES.rates | {"ivf/build": 1e7}  # a build longer than the encoding
    for rates in (RATES, IndexRates(slow, "slow build")):
        serial = plan(Workload(**base), rates)
        overlapped = plan(Workload(overlap_build=True, **base), rates)
        build, encode = serial.seconds["index_build"], serial.seconds["encode"]
        expected = max(build - encode, 0.0) + build * 1000 / 100_000
        assert overlapped.seconds["index_build"] == pytest.approx(expected)
        assert overlapped.hidden_seconds["index_build"] == pytest.approx(build - expected)
        assert overlapped.refresh_s < serial.refresh_s


def test_more_indexer_cores_scale_the_index_terms_only() -> None:
    base = dict(docs=100_000, dim=64, replicas=1, docs_per_s=100.0, train_queries=1000)
    two, eight = plan(Workload(**base), RATES), plan(Workload(indexer_cpus=8, **base), RATES)
    for name in ("index_build", "search_train"):
        assert eight.seconds[name] == pytest.approx(two.seconds[name] / 4)
    assert eight.seconds["encode"] == two.seconds["encode"]


def test_hnsw_quantizer_replaces_brute_force_assignment() -> None:
    flat_q = IndexConfig(type="ivfpq")
    graph_q = IndexConfig.model_validate({"type": "ivfpq", "ivf": {"quantizer": "hnsw"}})
    n, d = 100_000_000, 384
    nlist = capacity.ivf_lists(graph_q, n)
    parts = capacity.index_work_parts(graph_q, "build", n, d)
    assert set(parts) == {"ivfpq/build", "hnsw/build", "ivf-quantizer/hnsw"}
    # n vectors × ef × d × log2(nlist) graph steps instead of n × nlist × d.
    assert parts["ivf-quantizer/hnsw"] == pytest.approx(n * 128 * d * np.log2(nlist))
    flat_parts = capacity.index_work_parts(flat_q, "build", n, d)
    assert flat_parts["ivfpq/build"] - parts["ivfpq/build"] == pytest.approx(n * nlist * d)
    # At equal rates the k-means training (the same in both) is what is left.
    assert RATES.index_seconds(graph_q, "build", n, d) < RATES.index_seconds(
        flat_q, "build", n, d) / 4
    search = capacity.index_work_parts(graph_q, "search", n, d, queries=10, k=100)
    assert search["ivf-quantizer/hnsw"] == pytest.approx(10 * 128 * d * np.log2(nlist))


def test_ivf_work_and_lists() -> None:
    cfg = IndexConfig(type="ivf")
    assert capacity.ivf_lists(cfg, 1_000_000) == 4000  # 4·sqrt(N)
    assert capacity.ivf_lists(cfg, 10_000) == 256  # 400 lists need 15,600 points: N/39
    assert capacity.ivf_train_size(cfg, 1_000_000) == 4000 * 39
    build = index_work(cfg, "build", 1_000_000, 8)
    assert build == pytest.approx(10 * 156_000 * 4000 * 8 + 1_000_000 * 4000 * 8)
    search = index_work(cfg, "search", 1_000_000, 8, queries=10)
    assert search == pytest.approx(10 * (4000 * 8 + 32 * 250 * 8))


@pytest.mark.parametrize("kind", ["flat", "ivf", "ivfpq", "hnsw", "ivfpq+hnswq"])
def test_index_bytes_match_faiss(kind: str) -> None:
    docs, dim = 8000, 32
    vectors = clustered_vectors(docs, dim, 40, np.random.default_rng(0))
    kind, _, quantizer = kind.partition("+")
    config = IndexConfig.model_validate({"type": kind, **({"pq": {"m": 8}} if kind == "ivfpq"
                                                          else {}),
                                         **({"ivf": {"quantizer": "hnsw"}} if quantizer
                                            else {})})
    index = AnnIndex(dim, config, "cosine", expected_size=docs)
    index.add(np.arange(docs), vectors)
    index.finalize()
    predicted = index_bytes(config, docs, dim) - docs * capacity.ID_BYTES  # FAISS part only
    assert index.nbytes() == pytest.approx(predicted, rel=0.02)


def test_workload_takes_settings_from_a_run_config() -> None:
    cfg = parse_config({"data": {"path": "d"}, "model": {"max_doc_length": 128},
                        "inference": {"shard_size": 500},
                        "negatives": {"sampling": "simans", "top_k": 300},
                        "index": {"type": "ivf", "ivf": {"nlist": 64}, "partitions": 3}})
    load = capacity.workload(docs=10_000, dim=32, replicas=2, docs_per_s=10.0,
                             train_queries=100, doc_tokens=256, config=cfg,
                             index_type="ivfpq")
    assert (load.shard_size, load.mine_depth, load.doc_tokens) == (500, 100, 128)
    assert load.index.type == "ivfpq" and load.index.ivf.nlist == 64
    assert load.partitions == 3
    assert load.overlap_build  # index.build_while_encoding, on by default
    off = parse_config({"data": {"path": "d"}, "index": {"build_while_encoding": False}})
    assert not capacity.workload(docs=10, dim=8, replicas=1, docs_per_s=1.0, train_queries=1,
                                 config=off).overlap_build


def test_throughput_from_an_encode_report(tmp_path: Path) -> None:
    report = tmp_path / "encode.json"
    report.write_text(json.dumps({"params": {"mean_tokens": 240.0, "max_length": 256},
                                  "results": {"ours": {"docs_per_s": 24.0}}}))
    measured = capacity.throughput_from_benchmark(report)  # an older report: "ours" is fp32
    assert (measured.docs_per_s, measured.tokens, measured.precision) == (24.0, 240.0, "fp32")
    assert measured.at(120) == pytest.approx(48.0)
    report.write_text(json.dumps({"params": {"mean_tokens": 240.0, "max_length": 256},
                                  "results": {"ours fp32": {"docs_per_s": 10.0},
                                              "ours bf16": {"docs_per_s": 30.0}}}))
    bf16 = capacity.throughput_from_benchmark(report, "bf16")
    assert (bf16.docs_per_s, bf16.precision) == (30.0, "bf16") and "'ours bf16'" in bf16.source
    assert capacity.throughput_from_benchmark(report, "fp32").docs_per_s == 10.0
    with pytest.raises(ValueError, match="no row for precision int8"):
        capacity.throughput_from_benchmark(report, "int8")
    report.write_text("{}")
    with pytest.raises(ValueError, match="neither"):
        capacity.throughput_from_benchmark(report)


def test_the_rate_is_rescaled_to_the_tokens_left_after_the_cap() -> None:
    """A rate measured at 240 tokens, a run cutting documents at 128: the plan encodes at
    240/128 of the measured docs/s (not at the uncapped --doc-tokens' rate) and says so."""
    cfg = parse_config({"data": {"path": "d"}, "model": {"max_doc_length": 128}})
    measured = capacity.Throughput(30.0, 240.0, "bf16", "encode.json row 'ours bf16'")
    load = capacity.workload(docs=1000, dim=8, replicas=1, train_queries=10, doc_tokens=256,
                             measured=measured, config=cfg)
    assert load.doc_tokens == 128 and load.docs_per_s == pytest.approx(30.0 * 240 / 128)
    assert "56.2 docs/s per replica at 128 tokens/doc, bf16" in load.rate
    assert "'ours bf16'" in load.rate
    with pytest.raises(ValueError, match="once"):
        capacity.workload(docs=1, dim=8, replicas=1, train_queries=1, docs_per_s=1.0,
                          measured=measured)


def test_plan_precision_follows_inference_precision(tmp_path: Path) -> None:
    """Without --precision the plan takes the row of the precision inference.precision
    resolves to on this machine (the inferencer's own resolve_precision); --precision picks
    another machine's."""
    from ance_train.modeling.encoding import resolve_precision

    runner = CliRunner()
    repo = Path(__file__).resolve().parents[1]
    args = ["plan", "--docs", "1000", "--train-queries", "10", "--throughput-json",
            str(repo / "docs" / "benchmarks" / "encode.json"), "--json"]
    fp32 = tmp_path / "fp32.yaml"
    fp32.write_text("data: {path: d}\ninference: {precision: fp32}\n")
    auto = tmp_path / "auto.yaml"
    auto.write_text("data: {path: d}\n")
    local = resolve_precision("auto", "cpu")
    for config, precision in ((fp32, "fp32"), (auto, local)):
        out = json.loads(runner.invoke(app, [*args, "--config", str(config)]).output)
        assert f", {precision}: " in out["workload"]["rate"], out["workload"]["rate"]
    out = json.loads(runner.invoke(app, [*args, "--config", str(fp32), "--precision",
                                         "int8"]).output)
    assert "'ours int8'" in out["workload"]["rate"]


def _readme_plan_example() -> list[str]:
    """The README's plan command checked against a measured run (the block with --set)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    [block] = [b for b in blocks if "ance-train plan" in b and "--set" in b]
    return shlex.split(block.replace("\\\n", " "))


def test_the_readme_plan_example_predicts_its_measured_run(monkeypatch) -> None:
    """The README's example plans the 2-replica refresh of refresh_scaling.json from
    encode.json's rate; its encoding term is within 25% of the replicas' measured encoding
    time (median of the run's refreshes), and the README quotes both numbers."""
    repo = Path(__file__).resolve().parents[1]
    command = _readme_plan_example()
    assert command[:2] == ["ance-train", "plan"]
    monkeypatch.chdir(repo)  # the example's paths are relative to the repository
    result = CliRunner().invoke(app, [*command[1:], "--json"])
    assert result.exit_code == 0, result.output
    predicted = json.loads(result.output)["seconds"]["encode"]
    scaling = json.loads((repo / "docs" / "benchmarks" / "refresh_scaling.json").read_text())
    [run] = [r for r in scaling["runs"] if r["replicas"] == 2]
    assert command[command.index("--replicas") + 1] == "2"
    assert command[command.index("--docs") + 1] == str(run["corpus_docs"])
    measured = float(np.median([r["parts_s"]["encode"] for r in run["refreshes"]]))
    assert predicted == pytest.approx(measured, rel=0.25), (predicted, measured)
    readme = (repo / "README.md").read_text()
    assert f"encoded for\n{measured:.1f} s" in readme or f"encoded for {measured:.1f} s" in readme
    assert f"predicts {predicted:.1f} s of encoding ({predicted / measured:.2f}×" in readme


def test_plan_command(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["plan", "--docs", "20000", "--train-queries", "100",
                                 "--docs-per-s", "40", "--replicas", "2", "--dim", "64",
                                 "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["index_bytes"] == 20_000 * (64 * 4 + 8)
    assert out["seconds"]["encode"] == pytest.approx(10 * 1000 / 40 + 100 / (40 * 256 / 32))
    assert "refresh" in runner.invoke(app, ["plan", "--docs", "20000", "--train-queries", "100",
                                            "--docs-per-s", "40"]).output
    split = json.loads(runner.invoke(app, [
        "plan", "--docs", "20000", "--train-queries", "100", "--docs-per-s", "40",
        "--dim", "64", "--partitions", "2", "--embedding-dtype", "float16", "--index-type",
        "ivfpq", "--ivf-quantizer", "hnsw", "--indexer-cpus", "8", "--overlap-build",
        "--json"]).output)
    assert split["pods"] == {"inferencer": 1, "indexer": 2}
    assert split["workload"]["embedding_bytes"] == 2
    assert split["workload"]["index"]["ivf"]["quantizer"] == "hnsw"
    assert "index_build" in split["hidden_seconds"] and "merge" in split["seconds"]
    both = runner.invoke(app, ["plan", "--docs", "10", "--train-queries", "1"])
    assert both.exit_code == 2 and "exactly one" in both.output


def test_an_ivf_build_holds_its_k_means_sample_twice() -> None:
    """IVF: the vectors waiting for training and the concatenated sample (ann.AnnIndex._train)
    sit beside the two indexes while a build trains; the lists grow by doubling."""
    ivf = IndexConfig(type="ivfpq", pq=PqConfig(m=8))
    load = Workload(docs=1_000_000, dim=32, replicas=1, docs_per_s=1000.0, train_queries=10,
                    shard_size=50_000, index=ivf)
    result = plan(load, RATES)
    sample = capacity.ivf_train_size(ivf, 1_000_000) * 32 * 4
    assert sample == 4000 * 39 * 32 * 4
    assert result.partition_bytes == 2 * result.index_bytes + 2 * sample + 50_000 * (32 * 8 + 8)
    codes = 1_000_000 * (8 + 8)  # PQ codes + ids in the lists, 1.5 × for their growth
    assert result.index_bytes == (1.5 * codes + 4000 * 32 * 4 + 256 * 32 * 4
                                  + 1_000_000 * 8 + 1_000_000 * 8)
    assert result.index_bytes == index_bytes(ivf, 1_000_000, 32) + 0.5 * codes
