"""`ance-train data convert pairs|hf`: real JSONL, CSV, Parquet files and a `datasets` folder
into the BEIR layout, which the project's own validation then reads."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ance_train.config import DataConfig
from ance_train.data.convert import text_id
from ance_train.data.validation import validate_dataset

PAIRS = [
    {"anchor": "what causes fever", "positive": "Fever is caused by infection.",
     "negative": "The weather is warm today."},
    {"anchor": "vitamin d and bones", "positive": "Vitamin D keeps bones strong.",
     "negative": "Fever is caused by infection."},  # a positive elsewhere: one document
    {"anchor": "what causes fever", "positive": "Fever is caused by infection.",
     "negative": "Cats sleep a lot."},  # the same pair again
    {"anchor": "  ", "positive": "Orphan text.", "negative": None},  # empty query
    {"anchor": "lonely query", "positive": "", "negative": "Unused."},  # no positive
    {"anchor": "sleep and memory", "positive": "Sleep consolidates memory.",
     "negative": "Sleep consolidates memory."},  # negative = its positive
    {"anchor": "coffee", "positive": "Coffee contains caffeine.", "negative": ""},
    {"anchor": "tea", "positive": "Tea contains caffeine too.",
     "negative": "The weather is warm today."},
    {"anchor": "exercise", "positive": "Exercise lowers blood pressure.",
     "negative": "Cats sleep a lot."},
    {"anchor": "salt", "positive": "Salt raises blood pressure.",
     "negative": "Coffee contains caffeine."},
]
TEST_PAIRS = [("what is caffeine", "Coffee contains caffeine."),
              ("salt", "Salt raises blood pressure."),  # also a training query: test only
              ("why do we sleep", "Sleep restores the brain.")]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_csv(path: Path, header: list[str], rows: list[tuple]) -> Path:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def ance(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ance_train.cli", *args], capture_output=True,
                          text=True, timeout=180)


def read_beir(directory: Path) -> tuple[dict, dict, dict]:
    corpus = {d["_id"]: d["text"] for d in map(json.loads, (directory / "corpus.jsonl").open())}
    queries = {q["_id"]: q["text"] for q in map(json.loads, (directory / "queries.jsonl").open())}
    qrels: dict[str, dict[str, set[str]]] = {}
    for split in ("train", "dev", "test"):
        path = directory / "qrels" / f"{split}.tsv"
        if path.is_file():
            lines = path.read_text().splitlines()
            assert lines[0] == "query-id\tcorpus-id\tscore"
            for line in lines[1:]:
                query, doc, score = line.split("\t")
                assert score == "1"
                qrels.setdefault(split, {}).setdefault(query, set()).add(doc)
    return corpus, queries, qrels


def validates(directory: Path, tmp_path: Path, dev_split: str = "auto"):
    return validate_dataset(DataConfig(path=str(directory), dev_split=dev_split,
                                       dev_fraction=0.0 if dev_split == "auto" else 0.2),
                            tmp_path / f"cache-{directory.name}")


def test_jsonl_pairs_with_test_csv_and_dev_fraction(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    test = write_csv(tmp_path / "test.csv", ["query", "positive"], TEST_PAIRS)
    out = tmp_path / "beir"
    result = ance("data", "convert", "pairs", str(train), "--to", str(out), "--test", str(test),
                  "--dev-fraction", "0.25")
    assert result.returncode == 0, result.stderr
    corpus, queries, qrels = read_beir(out)

    texts = list(corpus.values())
    assert len(texts) == len(set(texts))  # identical documents are one entry
    assert corpus[text_id("d", "Fever is caused by infection.")] == "Fever is caused by infection."
    assert "Cats sleep a lot." in texts and "The weather is warm today." in texts  # negatives
    assert "Orphan text." not in texts and "Unused." not in texts  # of dropped rows
    # test queries are only in test; a query in both files is dropped from train
    salt = text_id("q", "salt")
    assert salt in qrels["test"] and salt not in qrels["train"] and salt not in qrels["dev"]
    train_and_dev = set(qrels["train"]) | set(qrels["dev"])
    assert len(train_and_dev) == 6 and len(qrels["dev"]) == 2  # round(0.25 * 6) held out
    assert set(qrels["train"]).isdisjoint(qrels["dev"])
    fever = text_id("q", "what causes fever")
    assert queries[fever] == "what causes fever"
    assert qrels.get("train", {}).get(fever, qrels["dev"].get(fever)) == {
        text_id("d", "Fever is caused by infection.")}

    report = json.loads((out / "conversion.json").read_text())
    assert report["dropped"] == {
        "missing or empty query text": 1, "missing or empty positive": 1,
        "duplicate (query, positive) pair in train": 1,
        "negative equal to a positive of its query": 1, "empty negative text": 1,
        "query also in the test split (kept there only, not in train)": 1}
    assert report["examples"]["missing or empty query text"] == [f"{train} line 4"]
    assert "dropped 1: missing or empty positive" in result.stdout
    assert f"{train} line 5" in result.stdout

    index = validates(out, tmp_path)  # the project's own reader accepts it
    assert index.num_docs == len(corpus)
    assert (len(index.train), len(index.dev), len(index.test)) == (4, 2, 3)

    # stable ids: the same pairs in another order give the same files
    again = ance("data", "convert", "pairs", str(write_jsonl(tmp_path / "rev.jsonl",
                                                             PAIRS[::-1])),
                 "--to", str(tmp_path / "beir2"), "--test", str(test), "--dev-fraction", "0.25")
    assert again.returncode == 0, again.stderr
    corpus2, queries2, qrels2 = read_beir(tmp_path / "beir2")
    assert corpus2 == corpus and queries2 == queries and qrels2 == qrels


def test_csv_text_pairs_by_column_order_and_parquet(tmp_path: Path) -> None:
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [(f"question {i}", f"answer number {i}") for i in range(8)]
    csv_file = write_csv(tmp_path / "pairs.csv", ["left", "right"], rows)
    result = ance("data", "convert", "pairs", str(csv_file), "--to", str(tmp_path / "from-csv"))
    assert result.returncode == 0, result.stderr
    assert "8 rows → 8 documents (0 only as negatives), queries 8 train" in result.stdout

    table = pyarrow.table({"query": [r[0] for r in rows],
                           "pos": [[r[1], r[1] + " (again)"] for r in rows],
                           "negative_1": ["noise"] * 8, "negative_2": [None] * 8})
    pq.write_table(table, tmp_path / "pairs.parquet")
    result = ance("data", "convert", "pairs", str(tmp_path / "pairs.parquet"),
                  "--to", str(tmp_path / "from-parquet"))
    assert result.returncode == 0, result.stderr
    corpus, _, qrels = read_beir(tmp_path / "from-parquet")
    assert len(corpus) == 17  # 16 positives + one shared negative
    assert all(len(docs) == 2 for docs in qrels["train"].values())
    assert validates(tmp_path / "from-parquet", tmp_path, "train").num_docs == 17
    (tmp_path / "from-csv-again").mkdir()
    (tmp_path / "from-csv-again" / "keep.txt").write_text("mine")
    refused = ance("data", "convert", "pairs", str(csv_file), "--to",
                   str(tmp_path / "from-csv-again"))
    assert refused.returncode == 1 and "is not empty" in refused.stderr
    assert (tmp_path / "from-csv-again" / "keep.txt").read_text() == "mine"


def test_bad_rows_name_file_and_line_and_leave_nothing(tmp_path: Path) -> None:
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(PAIRS[0]) + "\n" + json.dumps(PAIRS[1]) + "\n{not json\n")
    result = ance("data", "convert", "pairs", str(broken), "--to", str(tmp_path / "a"))
    assert result.returncode == 1 and f"{broken} line 3: invalid JSON" in result.stderr
    pq.write_table(pyarrow.table({"anchor": ["q1", "q2"], "positive": ["d1", None],
                                  "negative": [None, None]}), tmp_path / "ok.parquet")
    pq.write_table(pyarrow.table({"anchor": ["q1", "q2"], "positive": [1, 2]}),
                   tmp_path / "numbers.parquet")
    result = ance("data", "convert", "pairs", str(tmp_path / "numbers.parquet"),
                  "--to", str(tmp_path / "b"))
    assert result.returncode == 1
    assert "numbers.parquet row 1: column 'positive' must hold text" in result.stderr
    extra = write_csv(tmp_path / "extra.csv", ["anchor", "positive"],
                      [("q", "d"), ("q2", "d2", "surplus")])
    result = ance("data", "convert", "pairs", str(extra), "--to", str(tmp_path / "c"))
    assert result.returncode == 1 and f"{extra} line 3: more fields" in result.stderr
    unknown = write_csv(tmp_path / "wide.csv", ["a", "b", "c", "d"], [("1", "2", "3", "4")])
    result = ance("data", "convert", "pairs", str(unknown), "--to", str(tmp_path / "d"))
    assert result.returncode == 1 and "--query-column" in result.stderr
    named = ance("data", "convert", "pairs", str(unknown), "--to", str(tmp_path / "d"),
                 "--query-column", "b", "--positive-column", "d")
    assert named.returncode == 0, named.stderr
    assert not any((tmp_path / name).exists() for name in "abc")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_hf_datasets_folder(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    train = datasets.Dataset.from_list(
        [{"anchor": f"query {i}", "positive": f"document {i}", "negative": "shared noise"}
         for i in range(6)] + [{"anchor": "query 0", "positive": "document 0",
                                "negative": "shared noise"}])
    validation = datasets.Dataset.from_list([{"anchor": "query 9", "positive": "document 9",
                                              "negative": "other noise"}])
    test = datasets.Dataset.from_list([{"anchor": "query 7", "positive": "document 7",
                                        "negative": ""}])
    folder = tmp_path / "hf"
    datasets.DatasetDict({"train": train, "validation": validation, "test": test}
                         ).save_to_disk(str(folder))
    out = tmp_path / "beir"
    result = ance("data", "convert", "hf", str(folder), "--to", str(out))
    assert result.returncode == 0, result.stderr
    corpus, queries, qrels = read_beir(out)
    assert {split: len(q) for split, q in qrels.items()} == {"train": 6, "dev": 1, "test": 1}
    assert sorted(corpus.values()).count("shared noise") == 1
    report = json.loads((out / "conversion.json").read_text())
    assert report["dropped"] == {"duplicate (query, positive) pair in train": 1,
                                 "empty negative text": 1}
    assert report["examples"]["duplicate (query, positive) pair in train"] == [
        f"{folder} split train row 7"]
    index = validates(out, tmp_path)
    assert (len(index.train), len(index.dev), len(index.test)) == (6, 1, 1)
    assert queries[text_id("q", "query 9")] == "query 9"

    plain = tmp_path / "plain"
    train.save_to_disk(str(plain))  # a Dataset, not a DatasetDict: its rows are train
    result = ance("data", "convert", "hf", str(plain), "--to", str(tmp_path / "beir-plain"),
                  "--dev-fraction", "0.5")
    assert result.returncode == 0, result.stderr
    _, _, qrels = read_beir(tmp_path / "beir-plain")
    assert (len(qrels["train"]), len(qrels["dev"])) == (3, 3)
    not_hf = ance("data", "convert", "hf", str(tmp_path / "beir"), "--to", str(tmp_path / "x"))
    assert not_hf.returncode == 1 and "not a Hugging Face datasets folder" in not_hf.stderr
