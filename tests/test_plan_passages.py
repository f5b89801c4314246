"""``ance-train plan`` with MaxP (``data.passages.mode: max``, ANCE arXiv:2007.00808 §5): the
corpus becomes docs × ``--passages-per-doc`` vectors, and the plan states what that costs
against FirstP (src/ance_train/index/capacity.py ``passage_cost``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ance_train.cli import app
from ance_train.config import parse_config
from ance_train.index import capacity

DOCS, QUERIES, EVAL, DIM = 5183, 809, 300, 384
BASE = ["plan", "--docs", str(DOCS), "--train-queries", str(QUERIES), "--eval-queries",
        str(EVAL), "--docs-per-s", "100"]
MAXP = ["--set", "data.passages.mode=max"]


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "run.yaml"
    path.write_text("data: {path: d}\n")
    return str(path)


def _plan(*args: str) -> dict:
    result = CliRunner().invoke(app, [*BASE, *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _refused(*args: str) -> str:
    result = CliRunner().invoke(app, [*BASE, *args])
    assert result.exit_code == 2, result.output
    return " ".join(result.output.split())  # rich wraps long messages


def test_maxp_counts_a_vector_per_passage(config: str) -> None:
    """Vectors = docs × passages per document; a flat index, its row map and the stored rows
    grow by that factor (each row + 2 bytes of passage number), encoding grows, and the
    FirstP baseline in the same output is the plan of mode first."""
    out = _plan("--config", config, *MAXP, "--passages-per-doc", "2.5")
    first = _plan("--config", config)
    cost = out["passages"]
    assert out["workload"]["vectors"] == cost["vectors"] == round(DOCS * 2.5)
    assert cost["firstp_vectors"] == DOCS
    row = DIM * 2 + 8  # float16 values + the document id
    # flat: vectors × (float32 vector + row → document id), exactly per vector
    assert out["index_bytes"] == cost["vectors"] * (DIM * 4 + 8)
    assert first["index_bytes"] == DOCS * (DIM * 4 + 8)
    assert cost["ratio"]["index_bytes"] == pytest.approx(2.5, rel=1e-4)
    assert out["storage_bytes"]["embeddings"] == (cost["vectors"] * (row + 2)
                                                  + (QUERIES + EVAL) * row)
    assert first["storage_bytes"]["embeddings"] == (DOCS + QUERIES + EVAL) * row
    assert out["storage_bytes"]["embeddings"] > 2.5 * DOCS * row
    # the FirstP baseline is the mode first plan on the same inputs
    assert cost["firstp"]["encode_s"] == first["seconds"]["encode"]
    assert cost["firstp"]["index_bytes"] == first["index_bytes"]
    assert cost["firstp"]["store_bytes_per_refresh"] == (
        first["storage_bytes"]["total"] - first["storage_bytes"]["checkpoint"])
    # encoding: the 256-token first passage + 1.5 full passages of 256 tokens per document
    assert out["workload"]["tokens_per_doc"] == 256 + 1.5 * 256
    assert out["seconds"]["encode"] > first["seconds"]["encode"]
    assert 2.0 < cost["ratio"]["encode_s"] < 2.5  # the query shards do not grow
    # flat search scans every vector: × 2.5; searches ask for k × max_passages passages
    assert cost["ratio"]["search_s"] == pytest.approx(2.5, rel=1e-4)
    assert cost["search_depth"] == {"mine": 200 * 4, "eval": 1000 * 4}
    assert "best_passage" in out["seconds"] and "best_passage" not in first["seconds"]
    for name in ("encode_s", "index_bytes", "store_bytes_per_refresh", "search_s"):
        assert cost["ratio"][name] == pytest.approx(cost["maxp"][name] / cost["firstp"][name])


def test_the_table_states_what_maxp_costs(config: str) -> None:
    result = CliRunner().invoke(app, [*BASE, "--config", config, *MAXP,
                                      "--passages-per-doc", "2.1"])
    assert result.exit_code == 0, result.output
    text = result.output
    assert "MaxP: 2.1 passages/doc (at most 4 of 256 tokens) → 10,884 vectors (FirstP: 5,183)" \
        in " ".join(text.split())
    for row in ("encode", "index memory/partition", "store per refresh", "search (train + eval)"):
        assert any(line.strip().startswith(row) and line.rstrip().endswith("×")
                   for line in text.splitlines()), (row, text)


def test_one_passage_per_document_costs_only_the_passage_numbers(config: str) -> None:
    """Mode max at 1 passage per document: FirstP's index and vectors; the shards hold
    2 more bytes per row (the passage number), the searches go 4 × deeper."""
    out = _plan("--config", config, *MAXP, "--passages-per-doc", "1")
    cost = out["passages"]
    assert cost["vectors"] == cost["firstp_vectors"] == DOCS
    assert cost["ratio"]["index_bytes"] == 1.0
    assert cost["ratio"]["encode_s"] == 1.0
    assert (cost["maxp"]["store_bytes_per_refresh"] - cost["firstp"]["store_bytes_per_refresh"]
            == 2 * DOCS)


def test_hnsw_search_grows_with_the_depth(config: str) -> None:
    """HNSW's search work follows max(ef_search, k) × log2(vectors): asking for k ×
    max_passages passages (200 → 800, 1000 → 4000) costs 4 × at the depth alone; partitions
    hold 1/P of the passages."""
    out = _plan("--config", config, *MAXP, "--passages-per-doc", "2", "--index-type", "hnsw")
    depth_and_size = 4 * math.log2(2 * DOCS) / math.log2(DOCS)
    assert out["passages"]["ratio"]["search_s"] == pytest.approx(depth_and_size)
    split = _plan("--config", config, *MAXP, "--passages-per-doc", "2", "--partitions", "2")
    assert split["index_bytes"] == 2 * 2592 * (DIM * 4 + 8)  # ceil(5183 / 2) docs × 2


def test_refusals(config: str) -> None:
    # mode max: only the corpus knows its passages per document
    message = _refused("--config", config, *MAXP)
    assert "--passages-per-doc" in message and "only the corpus knows it" in message
    # more than one passage with mode first (the config's, or the default without one)
    for args in (["--config", config], []):
        message = _refused(*args, "--passages-per-doc", "2")
        assert "data.passages.mode is first" in message and "--passages-per-doc 2" in message
    assert "data.passages.max_passages" in _refused("--config", config, *MAXP,
                                                    "--passages-per-doc", "5")
    assert "--passages-per-doc" in _refused("--passages-per-doc", "0.5")


def test_mode_first_output_is_unchanged(config: str) -> None:
    """Mode first: the plan of before this option (numbers taken from it on these inputs,
    those that do not depend on the index rates), no MaxP fields, and the same output with
    --passages-per-doc 1."""
    runner = CliRunner()
    plain = _plan()
    assert "passages" not in plain
    assert sorted(plain["workload"]) == [
        "dim", "doc_tokens", "docs", "docs_per_s", "embedding_bytes", "eval_depth",
        "eval_queries", "index", "indexer_cpus", "mine_depth", "model_params", "overlap_build",
        "partitions", "query_shard_size", "query_tokens", "rate", "replicas", "shard_size",
        "store_mb_s", "train_queries"]
    assert list(plain["seconds"]) == ["checkpoint_transfer", "encode", "embedding_transfer",
                                      "index_build", "search_train", "search_eval", "mine",
                                      "negatives_upload"]
    assert plain["seconds"]["encode"] == pytest.approx(61.38625)
    assert plain["seconds"]["embedding_transfer"] == pytest.approx(0.00818292)
    assert plain["hidden_seconds"]["embedding_transfer"] == pytest.approx(0.02011004)
    assert plain["storage_bytes"] == {"checkpoint": 272558592, "embeddings": 4882592,
                                      "negatives": 4045000, "total": 281486184}
    assert (plain["index_bytes"], plain["indexer_bytes"], plain["partition_bytes"]) == (
        8002552, 31340128, 23250128)
    assert _plan("--passages-per-doc", "1") == plain
    assert _plan("--config", config, "--passages-per-doc", "1") == _plan("--config", config)
    text = runner.invoke(app, BASE).output
    assert text == runner.invoke(app, [*BASE, "--passages-per-doc", "1"]).output
    assert "MaxP" not in text and "passage" not in text


def test_the_store_check_counts_passages() -> None:
    """run_store_bytes (the embedded run's disk check): MaxP refreshes hold a row per
    passage; without a count, max_passages per document (the most there can be)."""
    raw = {"data": {"path": "/d"}, "training": {"steps": 20, "refresh_every": 10,
                                                "warmup_steps": 1}}
    sizes = {"docs": 1000, "train_queries": 10, "eval_queries": 0, "dim": 8,
             "model_params": 1000}
    first = capacity.run_store_bytes(parse_config(raw), **sizes).parts["refreshes"]
    maxp = parse_config({**raw, "data": {"path": "/d", "passages": {"mode": "max"}}})
    row = 8 * 2 + 8
    refreshes = 3  # checkpoints 0, 10, 20
    at_most = capacity.run_store_bytes(maxp, **sizes).parts["refreshes"]
    assert at_most - first == refreshes * 1000 * (3 * row + 4 * 2)
    two = capacity.run_store_bytes(maxp, **sizes, passages_per_doc=2.0).parts["refreshes"]
    assert two - first == refreshes * 1000 * (row + 2 * 2)
