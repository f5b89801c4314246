"""`ance-train export-negatives`: a run's negatives table as sentence-transformers triplets or
Tevatron JSONL. The run is a real store (LocalStore) holding the dataset index the launcher
publishes and a NegativesTable written through the project's own APIs; no service starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ance_train.config import dump_config, load_config
from ance_train.data.formats import doc_text
from ance_train.data.validation import validate_dataset
from ance_train.infra.store import LocalStore
from ance_train.negatives.table import (
    PAD,
    NegativesTable,
    source_codes,
    store_table,
    uniform_probabilities,
)
from ance_train.protocol.tables import TableId
from ance_train.runtime import publish_dataset

from ance_train_dev.helpers import write_config

STEP = 20
DOCS = 30


def write_dataset(directory: Path) -> Path:
    (directory / "qrels").mkdir(parents=True)
    with open(directory / "corpus.jsonl", "w") as out:
        for d in range(DOCS):
            out.write(json.dumps({"_id": f"doc-{d}", "title": f"Title [{d}]",
                                  "text": f"body of document {d} ü"}) + "\n")
    queries = {f"q{q}": f"question number {q}" for q in range(10)}
    (directory / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in queries.items()))
    train = [(f"q{q}", f"doc-{q}") for q in range(8)] + [("q0", "doc-20")]  # q0: 2 positives
    test = [("q8", "doc-8"), ("q9", "doc-9")]
    for split, rows in (("train", train), ("test", test)):
        (directory / "qrels" / f"{split}.tsv").write_text(
            "query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t1\n" for q, d in rows))
    return directory


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, NegativesTable]:
    root = tmp_path_factory.mktemp("export-negatives")
    data = write_dataset(root / "data")
    model = root / "model"
    model.mkdir()
    run_dir = root / "runs" / "neg"
    run_dir.mkdir(parents=True)
    config = load_config(write_config(root / "c.yaml", run_id="neg",
                                      output_dir=str(root / "runs"), model={"path": str(model)},
                                      data={"path": str(data), "dev_fraction": 0.0}))
    (run_dir / "config.yaml").write_text(dump_config(config))  # as `ance-train run` does
    store = LocalStore("neg", str(run_dir / "store"))
    index = validate_dataset(config.data, root / "cache", seed=config.data.split_seed)
    publish_dataset(store, root / "cache")
    assert sorted(index.train) == [f"q{q}" for q in range(8)]

    rng = np.random.default_rng(0)
    query_ids = [*sorted(index.train), "q9"]  # q9: a test query, not a training one
    candidates = np.full((len(query_ids), 6), PAD, dtype=np.int64)
    for row in range(len(query_ids)):
        width = 6 if row % 2 == 0 else 4  # short rows are padded
        candidates[row, :width] = rng.choice(np.arange(21, DOCS), size=width, replace=False)
    candidates[1, 0] = 1  # q1's own positive: the indexer never writes it; the export drops it
    probabilities = uniform_probabilities(candidates)
    probabilities[2, 3] = 0.0  # underflowed (SimANS): never drawn, so never exported
    table = NegativesTable(step=STEP, query_ids=np.array(query_ids), candidates=candidates,
                           scores=rng.random(candidates.shape, dtype=np.float32),
                           positive_scores=np.ones(len(query_ids), np.float32),
                           probabilities=probabilities,
                           sources=source_codes(candidates, "ann"))
    store_table(store, TableId.ann(STEP).key, table, root / "scratch")
    return run_dir, table


def ance(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ance_train.cli", *args], capture_output=True,
                          text=True, timeout=180)


def corpus_of(run_dir: Path) -> list[dict]:
    data = Path(load_config(run_dir / "config.yaml").data.path)
    return [json.loads(line) for line in (data / "corpus.jsonl").open()]


def expected_negatives(table: NegativesTable) -> dict[str, list[int]]:
    """query id → doc indices the export must write: drawable, not a positive, in order."""
    positives = {f"q{q}": {q} for q in range(8)}
    positives["q0"].add(20)
    expected = {}
    for row, query in enumerate(table.query_ids.tolist()):
        if query in positives:
            expected[query] = [int(d) for d, p in zip(table.candidates[row],
                                                      table.probabilities[row], strict=True)
                               if d != PAD and p > 0 and d not in positives[query]]
    return expected


def test_tevatron(run, tmp_path: Path) -> None:
    run_dir, table = run
    out = tmp_path / "tevatron.jsonl"
    result = ance("export-negatives", "--run", str(run_dir), "--checkpoint", str(STEP),
                  "--format", "tevatron", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "skipped 1 table rows" in result.stdout  # q9
    assert "left out 1 candidates that are positives" in result.stdout
    corpus = corpus_of(run_dir)
    by_id = {doc["_id"]: doc for doc in corpus}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    expected = expected_negatives(table)
    assert [r["query_id"] for r in rows] == sorted(expected)
    for row in rows:
        query = row["query_id"]
        assert row["query"] == f"question number {query[1:]}"
        negatives = [p["docid"] for p in row["negative_passages"]]
        positives = [p["docid"] for p in row["positive_passages"]]
        assert negatives == [corpus[d]["_id"] for d in expected[query]]  # all in the table
        assert not set(negatives) & set(positives)
        assert sorted(positives) == sorted(["doc-0", "doc-20"] if query == "q0"
                                           else [f"doc-{query[1:]}"])
        for passage in row["positive_passages"] + row["negative_passages"]:
            doc = by_id[passage["docid"]]
            assert (passage["title"], passage["text"]) == (doc["title"], doc["text"])


def test_sentence_transformers_jsonl_and_folder(run, tmp_path: Path) -> None:
    run_dir, table = run
    out = tmp_path / "triplets.jsonl"
    result = ance("export-negatives", "--run", str(run_dir), "--checkpoint", str(STEP),
                  "--out", str(out), "--per-query", "3")
    assert result.returncode == 0, result.stderr
    corpus = corpus_of(run_dir)
    text = [doc_text(doc["title"], doc["text"]) for doc in corpus]
    expected = expected_negatives(table)
    queries = {f"question number {q[1:]}": q for q in expected}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == sum(min(3, len(n)) for n in expected.values())
    for query_text, query in queries.items():
        mine = [r for r in rows if r["anchor"] == query_text]
        assert [r["negative"] for r in mine] == [text[d] for d in expected[query][:3]]
        positives = {text[0], text[20]} if query == "q0" else {text[int(query[1:])]}
        assert {r["positive"] for r in mine} == positives  # q0's two taken in turn
        assert not {r["negative"] for r in mine} & positives

    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "triplets"
    result = ance("export-negatives", "--run", str(run_dir), "--checkpoint", str(STEP),
                  "--out", str(folder), "--per-query", "3")
    assert result.returncode == 0, result.stderr
    loaded = datasets.load_from_disk(str(folder))
    assert loaded.column_names == ["anchor", "positive", "negative"]
    assert loaded.to_list() == rows

    again = ance("export-negatives", "--run", str(run_dir), "--checkpoint", str(STEP),
                 "--out", str(out))
    assert again.returncode == 1 and "--overwrite" in again.stderr
    missing = ance("export-negatives", "--run", str(run_dir), "--checkpoint", "40",
                   "--out", str(tmp_path / "x.jsonl"))
    assert missing.returncode == 1
    assert f"no negatives table negatives/40.npz (stored: {STEP};" in missing.stderr
    assert not (tmp_path / "x.jsonl").exists()
