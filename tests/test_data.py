"""Tests of the dataset readers and validation (src/ance_train/data/)."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import numpy as np
import pytest

from ance_train.config import DataConfig
from ance_train.data.corpus import Corpus, open_corpus
from ance_train.data.dataset import DatasetIndex, is_positive, load_dataset_index
from ance_train.data.formats import DatasetFiles, doc_text
from ance_train.data.problems import MAX_ERRORS, DataError
from ance_train.data.validation import validate_dataset
from ance_train.protocol.work import shard_ranges

from ance_train_dev.helpers import scifact_dir

SCIFACT = scifact_dir()  # a missing copy fails the suite loudly, never skips

HEADER = "query-id\tcorpus-id\tscore"


# --------------------------------------------------------------------------- helpers


def _doc(doc_id: str, text: str, title: str = "T") -> str:
    return json.dumps({"_id": doc_id, "title": title, "text": text, "metadata": {}})


def _query(qid: str, text: str) -> str:
    return json.dumps({"_id": qid, "text": text, "metadata": {}})


def _write(path: Path, lines: list[str] | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(lines, bytes):
        path.write_bytes(lines)
    else:
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def _corpus_lines() -> list[str]:
    return [_doc(f"d{i}", f"text of document {i}", title=f"Title {i}") for i in range(1, 7)]


def _query_lines() -> list[str]:
    return [_query(f"q{i}", f"query {i}") for i in range(1, 6)]


def _train_lines() -> list[str]:
    return [HEADER, "q1\td1\t1", "q2\td2\t1", "q3\td3\t2", "q3\td4\t1"]


def make_beir(
    root: Path,
    corpus: list[str] | bytes | None = None,
    queries: list[str] | bytes | None = None,
    train: list[str] | bytes | None = None,
    test: list[str] | bytes | None = None,
) -> Path:
    """A small valid BEIR dataset; any file can be replaced."""
    _write(root / "corpus.jsonl", _corpus_lines() if corpus is None else corpus)
    _write(root / "queries.jsonl", _query_lines() if queries is None else queries)
    _write(root / "qrels" / "train.tsv", _train_lines() if train is None else train)
    _write(root / "qrels" / "test.tsv", [HEADER, "q5\td5\t1"] if test is None else test)
    return root


def cfg_for(root: Path, **overrides: object) -> DataConfig:
    return DataConfig(path=str(root), **overrides)


def error_of(root: Path, cache: Path, **overrides: object) -> str:
    with pytest.raises(DataError) as info:
        validate_dataset(cfg_for(root, **overrides), cache)
    return str(info.value)


# --------------------------------------------------------------------------- SciFact


def test_scifact_validates(tmp_path: Path) -> None:
    cfg = DataConfig(path=str(SCIFACT))
    index = validate_dataset(cfg, tmp_path)

    assert index.format == "beir"
    assert index.num_docs == 5183
    assert index.empty_doc_count == 0
    assert index.warnings == []
    n_dev = min(round(0.1 * 809), cfg.dev_max_queries)
    assert len(index.dev) == n_dev == 81
    assert len(index.train) == 809 - n_dev
    assert not set(index.train) & set(index.dev)
    assert len(index.test) == 300
    assert not (set(index.train) | set(index.dev)) & set(index.test)
    assert set(index.queries) == set(index.train) | set(index.dev) | set(index.test)

    offsets = np.load(tmp_path / "doc_offsets.npy")
    assert offsets.dtype == np.int64 and offsets.shape == (5183,)
    assert offsets[0] == 0
    assert load_dataset_index(tmp_path) == index

    lines = (SCIFACT / "corpus.jsonl").read_bytes().splitlines()
    with open_corpus(cfg, tmp_path) as corpus:
        assert len(corpus) == 5183
        for i in (0, 2591, 5182):
            obj = json.loads(lines[i])
            assert corpus.doc_id(i) == obj["_id"]
            assert corpus.text(i) == f"{obj['title']} {obj['text']}"
        assert corpus.texts([5182, 0, 2591]) == [
            corpus.text(5182),
            corpus.text(0),
            corpus.text(2591),
        ]
        for start, stop in ((0, 3), (2590, 2593), (5180, 5183)):
            expected = [(corpus.doc_id(i), corpus.text(i)) for i in range(start, stop)]
            assert list(corpus.iter_range(start, stop)) == expected

        # Qrels map to the right document indices.
        expected_pairs: set[tuple[str, str]] = set()
        for line in (SCIFACT / "qrels" / "train.tsv").read_text().splitlines()[1:]:
            qid, did, score = line.split("\t")
            if int(score) > 0:
                expected_pairs.add((qid, did))
        got_pairs = {
            (qid, corpus.doc_id(d))
            for split in (index.train, index.dev)
            for qid, docs in split.items()
            for d in docs
        }
        assert got_pairs == expected_pairs

    queries = {
        json.loads(x)["_id"]: json.loads(x)["text"]
        for x in (SCIFACT / "queries.jsonl").read_text().splitlines()
    }
    assert all(index.queries[q] == queries[q] for q in index.queries)


def test_scifact_validates_quickly(tmp_path: Path) -> None:
    import time

    start = time.perf_counter()
    validate_dataset(DataConfig(path=str(SCIFACT)), tmp_path)
    assert time.perf_counter() - start < 2.0


def test_scifact_split_is_deterministic_and_capped(tmp_path: Path) -> None:
    a = validate_dataset(DataConfig(path=str(SCIFACT)), tmp_path / "a", seed=1)
    b = validate_dataset(DataConfig(path=str(SCIFACT)), tmp_path / "b", seed=1)
    c = validate_dataset(DataConfig(path=str(SCIFACT)), tmp_path / "c", seed=2)
    assert a.dev == b.dev and a.train == b.train
    assert set(a.dev) != set(c.dev)

    capped = validate_dataset(
        DataConfig(path=str(SCIFACT), dev_max_queries=50, max_train_queries=100),
        tmp_path / "d",
        seed=1,
    )
    assert len(capped.dev) == 50
    assert len(capped.train) == 100
    assert not set(capped.train) & set(capped.dev)
    # The dev queries are the first of the same shuffle, so a smaller cap is a subset.
    assert set(capped.dev) <= set(a.dev)
    assert len(capped.queries) == 50 + 100 + 300


# --------------------------------------------------------------------------- small BEIR


def test_small_beir_maps_qrels_to_indices(tmp_path: Path) -> None:
    root = make_beir(tmp_path / "data")
    index = validate_dataset(cfg_for(root, dev_fraction=0.0), tmp_path / "cache")
    assert index.num_docs == 6
    assert index.dev == {}
    assert index.train == {"q1": {0: 1}, "q2": {1: 1}, "q3": {2: 2, 3: 1}}
    assert index.test == {"q5": {4: 1}}
    assert set(index.queries) == {"q1", "q2", "q3", "q5"}
    assert index.queries["q3"] == "query 3"


def test_dev_split_never_overlaps_train(tmp_path: Path) -> None:
    root = make_beir(tmp_path / "data")
    index = validate_dataset(cfg_for(root, dev_fraction=0.5), tmp_path / "cache")
    assert len(index.dev) == round(0.5 * 3)
    assert len(index.train) == 3 - len(index.dev)
    assert not set(index.train) & set(index.dev)
    assert set(index.train) | set(index.dev) == {"q1", "q2", "q3"}


def test_dev_split_keeps_one_training_query(tmp_path: Path) -> None:
    root = make_beir(tmp_path / "data", train=[HEADER, "q1\td1\t1"])
    index = validate_dataset(cfg_for(root, dev_fraction=0.9), tmp_path / "cache")
    assert index.train == {"q1": {0: 1}}
    assert index.dev == {}


def test_corpus_text_title_crlf_and_blank_lines(tmp_path: Path) -> None:
    corpus = (
        _doc("a", "alpha text", title="Alpha").encode()
        + b"\r\n"
        + b"\n"
        + json.dumps({"_id": "b", "text": "no title"}).encode()
        + b"\r\n"
        + json.dumps({"_id": "c", "title": None, "text": "null title"}).encode()
        + b"\n"
        + json.dumps({"_id": "d", "title": "", "text": "caf\u00e9 \u2028 x"}).encode("utf-8")
    )  # last line without newline
    root = make_beir(
        tmp_path / "data",
        corpus=corpus,
        train=["q1\ta\t1", "q2\td\t1"],  # no header
        test=[HEADER],
    )
    index = validate_dataset(cfg_for(root, dev_fraction=0.0), tmp_path / "cache")
    assert index.num_docs == 4
    assert index.train == {"q1": {0: 1}, "q2": {3: 1}}
    assert index.test == {}
    with open_corpus(cfg_for(root), tmp_path / "cache") as c:
        assert [c.doc_id(i) for i in range(4)] == ["a", "b", "c", "d"]
        assert c.text(0) == "Alpha alpha text"
        assert c.text(1) == "no title"
        assert c.text(2) == "null title"
        assert c.text(3) == "caf\u00e9 \u2028 x"
        assert list(c.iter_range(0, 10)) == [(c.doc_id(i), c.text(i)) for i in range(4)]
        assert list(c.iter_range(4, 4)) == []
        with pytest.raises(IndexError):
            c.text(4)
        with pytest.raises(IndexError):
            c.doc_id(-1)


def test_iter_range_survives_interleaved_random_access(tmp_path: Path) -> None:
    root = make_beir(tmp_path / "data")
    validate_dataset(cfg_for(root), tmp_path / "cache")
    with open_corpus(cfg_for(root), tmp_path / "cache") as c:
        got = []
        for doc_id, text in c.iter_range(1, 5):
            c.text(5)  # moves the shared file position
            got.append((doc_id, text))
        assert got == [(f"d{i}", f"Title {i} text of document {i}") for i in range(2, 6)]


def test_corpus_pickles_and_reopens(tmp_path: Path) -> None:
    root = make_beir(tmp_path / "data")
    validate_dataset(cfg_for(root), tmp_path / "cache")
    corpus = Corpus(
        DatasetFiles.resolve(cfg_for(root)), tmp_path / "cache" / "doc_offsets.npy", "beir"
    )
    clone = pickle.loads(pickle.dumps(corpus))
    assert len(clone) == 6
    assert clone.text(3) == corpus.text(3) == "Title 4 text of document 4"
    corpus.close()
    assert corpus.doc_id(2) == "d3"  # reopens lazily after close()


def test_missing_default_test_qrels_is_optional(tmp_path: Path) -> None:
    root = make_beir(tmp_path / "data")
    (root / "qrels" / "test.tsv").unlink()
    files = DatasetFiles.resolve(cfg_for(root))
    assert files.test_qrels is None
    assert validate_dataset(cfg_for(root), tmp_path / "cache").test == {}


def test_missing_files_are_named(tmp_path: Path) -> None:
    root = make_beir(tmp_path / "data")
    (root / "queries.jsonl").unlink()
    (root / "qrels" / "train.tsv").unlink()
    with pytest.raises(DataError) as info:
        DatasetFiles.resolve(cfg_for(root))
    message = str(info.value)
    assert message.startswith("2 problems")
    assert str(root / "queries.jsonl") in message
    assert str(root / "qrels" / "train.tsv") in message

    with pytest.raises(DataError, match=r"nope\.tsv"):
        DatasetFiles.resolve(cfg_for(make_beir(tmp_path / "d2"), test_qrels="nope.tsv"))
    with pytest.raises(DataError, match="does not exist"):
        DatasetFiles.resolve(cfg_for(tmp_path / "absent"))


def test_file_overrides(tmp_path: Path) -> None:
    root = make_beir(tmp_path / "data")
    (root / "corpus.jsonl").rename(root / "docs.jsonl")
    (root / "qrels" / "test.tsv").rename(root / "heldout.tsv")
    cfg = cfg_for(root, corpus_file="docs.jsonl", test_qrels="heldout.tsv")
    files = DatasetFiles.resolve(cfg)
    assert files.corpus == root / "docs.jsonl"
    assert files.test_qrels == root / "heldout.tsv"
    assert validate_dataset(cfg, tmp_path / "cache").test == {"q5": {4: 1}}


# --------------------------------------------------------------------------- errors


def test_invalid_json(tmp_path: Path) -> None:
    corpus = _corpus_lines()
    corpus[2] = '{"_id": "d3", "text": '
    message = error_of(make_beir(tmp_path / "data", corpus=corpus), tmp_path / "cache")
    assert "corpus.jsonl line 3: invalid JSON" in message


def test_not_an_object_and_non_string_id(tmp_path: Path) -> None:
    corpus = _corpus_lines()
    corpus[0] = '["d1", "text"]'
    corpus[4] = json.dumps({"_id": 5, "text": "x"})
    message = error_of(make_beir(tmp_path / "data", corpus=corpus), tmp_path / "cache")
    assert "corpus.jsonl line 1: expected a JSON object" in message
    assert 'corpus.jsonl line 5: field "_id" must be a string' in message


def test_missing_id(tmp_path: Path) -> None:
    corpus = _corpus_lines()
    corpus[1] = json.dumps({"title": "t", "text": "x"})
    message = error_of(make_beir(tmp_path / "data", corpus=corpus), tmp_path / "cache")
    assert 'corpus.jsonl line 2: missing field "_id"' in message


def test_missing_query_text(tmp_path: Path) -> None:
    queries = _query_lines()
    queries[3] = json.dumps({"_id": "q4"})
    message = error_of(make_beir(tmp_path / "data", queries=queries), tmp_path / "cache")
    assert 'queries.jsonl line 4: missing field "text"' in message


def test_duplicate_doc_id(tmp_path: Path) -> None:
    corpus = [*_corpus_lines(), _doc("d2", "again")]
    message = error_of(make_beir(tmp_path / "data", corpus=corpus), tmp_path / "cache")
    assert 'corpus.jsonl line 7: duplicate document id "d2" (first seen on line 2)' in message


def test_duplicate_query_id(tmp_path: Path) -> None:
    queries = [*_query_lines(), _query("q3", "again")]
    message = error_of(make_beir(tmp_path / "data", queries=queries), tmp_path / "cache")
    assert 'queries.jsonl line 6: duplicate query id "q3" (first seen on line 3)' in message


def test_qrels_unknown_doc_id(tmp_path: Path) -> None:
    train = [*_train_lines(), "q4\tnope\t1"]
    message = error_of(make_beir(tmp_path / "data", train=train), tmp_path / "cache")
    assert 'qrels/train.tsv line 6: unknown document id "nope"' in message


def test_qrels_unknown_query_id(tmp_path: Path) -> None:
    test = [HEADER, "q5\td5\t1", "q99\td1\t1"]
    message = error_of(make_beir(tmp_path / "data", test=test), tmp_path / "cache")
    assert 'qrels/test.tsv line 3: unknown query id "q99"' in message


def test_qrels_wrong_column_count(tmp_path: Path) -> None:
    train = [*_train_lines(), "q4\td4"]
    message = error_of(make_beir(tmp_path / "data", train=train), tmp_path / "cache")
    assert "qrels/train.tsv line 6: expected 3 columns, found 2" in message


def test_non_integer_relevance(tmp_path: Path) -> None:
    train = [HEADER, "q1\td1\t1", "q2\td2\t1.5", "q3\td3\thigh"]
    message = error_of(make_beir(tmp_path / "data", train=train), tmp_path / "cache")
    assert 'qrels/train.tsv line 3: relevance must be an integer, found "1.5"' in message
    assert 'qrels/train.tsv line 4: relevance must be an integer, found "high"' in message


def test_conflicting_repeated_judgement(tmp_path: Path) -> None:
    train = [*_train_lines(), "q1\td1\t1", "q2\td2\t0"]
    message = error_of(make_beir(tmp_path / "data", train=train), tmp_path / "cache")
    assert "qrels/train.tsv line 7" in message and "on line 3" in message
    assert "line 6" not in message  # an identical repeat is only a warning


def test_identical_repeated_judgement_is_a_warning(tmp_path: Path) -> None:
    train = [*_train_lines(), "q1\td1\t1", "q3\td4\t1"]
    root = make_beir(tmp_path / "data", train=train)
    index = validate_dataset(cfg_for(root, dev_fraction=0.0), tmp_path / "cache")
    assert index.warnings == ["qrels/train.tsv: 2 repeated judgements ignored"]
    assert index.train == {"q1": {0: 1}, "q2": {1: 1}, "q3": {2: 2, 3: 1}}


def test_non_utf8_bytes(tmp_path: Path) -> None:
    lines = [line.encode() for line in _corpus_lines()]
    lines[3] = b'{"_id": "d4", "title": "caf\xe9", "text": "x"}'
    message = error_of(
        make_beir(tmp_path / "data", corpus=b"\n".join(lines) + b"\n"), tmp_path / "cache"
    )
    assert "corpus.jsonl line 4: not valid UTF-8" in message
    assert "0xe9" in message


def test_non_utf8_in_qrels(tmp_path: Path) -> None:
    train = ("\n".join(_train_lines()) + "\n").encode() + b"q\xff\td1\t1\n"
    message = error_of(make_beir(tmp_path / "data", train=train), tmp_path / "cache")
    assert "qrels/train.tsv line 6: not valid UTF-8" in message


def test_no_training_qrels(tmp_path: Path) -> None:
    root = make_beir(tmp_path / "data", train=[HEADER, "q1\td1\t0", "q2\td2\t0"])
    message = error_of(root, tmp_path / "cache")
    assert "qrels/train.tsv" in message and "no training judgements with relevance > 0" in message

    root = make_beir(tmp_path / "data2", train=[HEADER])
    assert "no training judgements" in error_of(root, tmp_path / "cache")


def test_all_errors_reported_at_once(tmp_path: Path) -> None:
    corpus = _corpus_lines()
    corpus[1] = "not json"
    queries = [*_query_lines(), _query("q1", "dup")]
    train = [*_train_lines(), "q1\td1\tx", "zz\td1\t1"]
    root = make_beir(tmp_path / "data", corpus=corpus, queries=queries, train=train)
    message = error_of(root, tmp_path / "cache")
    first, *rest = message.splitlines()
    assert first.startswith("5 problems")
    assert any("corpus.jsonl line 2: invalid JSON" in line for line in rest)
    assert any('queries.jsonl line 6: duplicate query id "q1"' in line for line in rest)
    assert any("qrels/train.tsv line 6: relevance must be an integer" in line for line in rest)
    assert any('qrels/train.tsv line 7: unknown query id "zz"' in line for line in rest)
    # d2 was on the broken line, so the qrels naming it fail too.
    assert any('qrels/train.tsv line 3: unknown document id "d2"' in line for line in rest)
    assert len(rest) == 5


def test_error_list_is_capped(tmp_path: Path) -> None:
    corpus = [*_corpus_lines(), *(["{bad"] * 30)]
    message = error_of(make_beir(tmp_path / "data", corpus=corpus), tmp_path / "cache")
    lines = message.splitlines()
    assert lines[0].startswith("30 problems")
    assert len(lines) == 1 + MAX_ERRORS + 1
    assert lines[-1].strip() == f"…and {30 - MAX_ERRORS} more"
    assert "corpus.jsonl line 7:" in lines[1]


# --------------------------------------------------------------------------- empty texts


def test_empty_documents_are_accepted_with_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    corpus = [
        *_corpus_lines(),
        _doc("e1", "", title=""),
        json.dumps({"_id": "e2", "text": "  \t "}),
        _doc("e3", " ", title=" "),
        _doc("t-only", "", title="Just a title"),
    ]
    root = make_beir(tmp_path / "data", corpus=corpus, train=[*_train_lines(), "q4\te2\t1"])
    with caplog.at_level(logging.WARNING, logger="ance_train.data.validation"):
        index = validate_dataset(cfg_for(root, dev_fraction=0.0), tmp_path / "cache")
    assert index.empty_doc_count == 3
    expected = 'corpus.jsonl: 3 documents have empty text: "e1", "e2", "e3"'
    assert index.warnings == [expected]
    assert expected in caplog.text
    assert index.train["q4"] == {7: 1}
    with open_corpus(cfg_for(root), tmp_path / "cache") as c:
        assert c.text(6) == ""
        assert c.text(9) == "Just a title"


def test_many_empty_documents_are_summarised(tmp_path: Path) -> None:
    corpus = [*_corpus_lines(), *(_doc(f"e{i:02d}", "", title="") for i in range(13))]
    root = make_beir(tmp_path / "data", corpus=corpus)
    index = validate_dataset(cfg_for(root), tmp_path / "cache")
    assert index.empty_doc_count == 13
    names = ", ".join(f'"e{i:02d}"' for i in range(10))
    assert index.warnings == [f"corpus.jsonl: 13 documents have empty text: {names}, …and 3 more"]


def test_empty_query_is_accepted_with_warning(tmp_path: Path) -> None:
    queries = [*_query_lines()[:-1], _query("q5", " ")]
    root = make_beir(tmp_path / "data", queries=queries)
    index = validate_dataset(cfg_for(root), tmp_path / "cache")
    assert index.warnings == ['queries.jsonl: 1 query has empty text: "q5"']
    assert index.queries["q5"] == " "


# --------------------------------------------------------------------------- MS MARCO


def make_msmarco(root: Path) -> Path:
    passages = [
        ("100", "first passage"),
        ("7", "second passage"),
        ("42", "third"),
        ("3", "fourth passage"),
        ("55", "fifth"),
    ]
    _write(root / "collection.tsv", [f"{pid}\t{text}" for pid, text in passages])
    _write(root / "queries.tsv", ["1\twhat is one", "2\twhat is two", "9\tnine?", "10\tten"])
    _write(root / "qrels.train.tsv", ["1\t0\t42\t1", "2\t0\t3\t2", "2\t0\t100\t0", "9\t0\t7\t1"])
    _write(root / "qrels.dev.tsv", ["10 0 55 1", "10 Q0 100 1"])  # whitespace separated
    return root


def test_msmarco_layout(tmp_path: Path) -> None:
    root = make_msmarco(tmp_path / "marco")
    cfg = DataConfig(format="msmarco", path=str(root), dev_fraction=0.0)
    index = validate_dataset(cfg, tmp_path / "cache")
    assert index.format == "msmarco"
    assert index.num_docs == 5
    assert index.train == {"1": {2: 1}, "2": {3: 2}, "9": {1: 1}}  # rel 0 left out
    assert index.test == {"10": {4: 1, 0: 1}}
    assert index.queries == {"1": "what is one", "2": "what is two", "9": "nine?", "10": "ten"}
    with open_corpus(cfg, tmp_path / "cache") as corpus:
        assert corpus.doc_id(2) == "42"
        assert corpus.text(2) == "third"
        assert corpus.texts([4, 0]) == ["fifth", "first passage"]
        assert list(corpus.iter_range(3, 5)) == [("3", "fourth passage"), ("55", "fifth")]


def test_msmarco_qrels_with_header_and_wrong_columns(tmp_path: Path) -> None:
    root = make_msmarco(tmp_path / "marco")
    _write(root / "qrels.train.tsv", ["qid\titer\tpid\trel", "1\t0\t42\t1"])
    cfg = DataConfig(format="msmarco", path=str(root), dev_fraction=0.0)
    assert validate_dataset(cfg, tmp_path / "cache").train == {"1": {2: 1}}

    _write(root / "collection.tsv", ["100\tfirst", "7\tsecond\textra", "42\tthird"])
    _write(root / "queries.tsv", ["1\twhat is one", "2", "9\tnine?", "10\tten"])
    _write(root / "qrels.train.tsv", ["1\t0\t42\t1", "1\t42\t1"])
    message = error_of(root, tmp_path / "cache", format="msmarco")
    assert "collection.tsv line 2: expected 2 tab-separated columns (pid, text), found 3" in message
    assert "queries.tsv line 2: expected 2 tab-separated columns (qid, text), found 1" in message
    assert "qrels.train.tsv line 2: expected 4 columns, found 3" in message


# --------------------------------------------------------------------------- cache files


def test_failed_validation_keeps_previous_good_files(tmp_path: Path) -> None:
    root = make_beir(tmp_path / "data")
    cache = tmp_path / "cache"
    good = validate_dataset(cfg_for(root), cache)
    before = {p.name: p.read_bytes() for p in cache.iterdir()}
    assert set(before) == {"dataset.json", "doc_offsets.npy"}

    corpus = _corpus_lines()
    corpus.insert(0, _doc("new", "shifts every offset"))
    corpus[3] = "{broken"
    _write(root / "corpus.jsonl", corpus)
    with pytest.raises(DataError):
        validate_dataset(cfg_for(root), cache)
    after = {p.name: p.read_bytes() for p in cache.iterdir()}
    assert after == before  # unchanged, and no temporary files left behind
    assert load_dataset_index(cache) == good


def test_index_json_round_trip(tmp_path: Path) -> None:
    index = DatasetIndex(
        format="beir",
        num_docs=10,
        queries={"a": "x"},
        train={"a": {3: 1, 7: 2}},
        dev={"b": {0: 1}},
        test={},
        warnings=["w"],
        empty_doc_count=1,
    )
    again = DatasetIndex.from_json(index.to_json())
    assert again == index
    assert all(isinstance(d, int) for d in again.train["a"])
    with pytest.raises(DataError, match="cannot read dataset index"):
        load_dataset_index(tmp_path)


# --------------------------------------------------------------------------- helpers


def test_shard_ranges() -> None:
    assert shard_ranges(0, 10) == []
    assert shard_ranges(10, 5) == [(0, 5), (5, 10)]
    assert shard_ranges(11, 5) == [(0, 5), (5, 10), (10, 11)]
    assert shard_ranges(3, 100) == [(0, 3)]
    ranges = shard_ranges(5183, 1000)
    assert [i for s, e in ranges for i in range(s, e)] == list(range(5183))
    with pytest.raises(ValueError):
        shard_ranges(10, 0)


def test_doc_text() -> None:
    assert doc_text("Title", "body") == "Title body"
    assert doc_text("", "body") == "body"
    assert doc_text("  ", "body") == "body"
    assert doc_text("Title", "") == "Title"
    assert doc_text("", "") == ""


# --------------------------------------------------------------------------- positives


def test_is_positive_is_relevance_above_zero() -> None:
    assert [is_positive(rel) for rel in (-1, 0, 1, 2, 3)] == [False, False, True, True, True]


def test_positives_of_a_query() -> None:
    index = DatasetIndex(format="beir", num_docs=10, queries={},
                         train={"a": {7: 1, 3: 2, 5: 0, 9: -1}, "z": {4: 0}},
                         dev={"b": {2: 1, 0: 1}}, test={"c": {8: 3}})
    assert index.positives("a") == [3, 7]  # sorted; graded 0 (and below) are not positives
    assert index.positives("a", "train") == [3, 7]
    assert index.positives("z") == []
    assert index.positives("b", "dev") == [0, 2]
    assert index.positives("c", "test") == [8]
    with pytest.raises(KeyError):
        index.positives("b")  # b is a dev query, not a training one
    with pytest.raises(ValueError, match="unknown split 'eval'"):
        index.positives("a", "eval")


def test_positives_of_a_validated_dataset(tmp_path: Path) -> None:
    root = make_msmarco(tmp_path / "marco")  # query 2 judges document 100 with relevance 0
    cfg = DataConfig(format="msmarco", path=str(root), dev_fraction=0.0)
    index = validate_dataset(cfg, tmp_path / "cache")
    assert {q: index.positives(q) for q in index.train} == {"1": [2], "2": [3], "9": [1]}
    assert index.positives("10", "test") == [0, 4]



# --------------------------------------------------------------------------- dev qrels


def test_official_dev_qrels_replace_the_train_slice(tmp_path: Path) -> None:
    """data.dev_split auto: a BEIR qrels/dev.tsv is the dev split, nothing is cut from train;
    graded relevance is kept as judged (evaluation uses graded nDCG)."""
    root = make_beir(tmp_path / "data")
    _write(root / "qrels" / "dev.tsv", [HEADER, "q4\td6\t2", "q4\td1\t1", "q4\td2\t0"])
    index = validate_dataset(cfg_for(root, dev_fraction=0.5), tmp_path / "cache")
    assert index.dev == {"q4": {5: 2, 0: 1}}  # relevance 0 is judged non-relevant
    assert set(index.train) == {"q1", "q2", "q3"}  # dev_fraction ignored: no slice cut
    assert DatasetFiles.resolve(cfg_for(root)).dev_qrels == root / "qrels" / "dev.tsv"

    # dev_split train: the file is ignored and the slice is cut from train as before.
    sliced = validate_dataset(cfg_for(root, dev_fraction=0.5, dev_split="train"),
                              tmp_path / "cache2")
    assert "q4" not in sliced.dev and len(sliced.dev) == 2 and len(sliced.train) == 1


def test_dev_qrels_override_and_missing_files(tmp_path: Path) -> None:
    root = make_beir(tmp_path / "data")
    _write(root / "heldout-dev.tsv", [HEADER, "q4\td6\t1"])
    index = validate_dataset(cfg_for(root, dev_qrels="heldout-dev.tsv"), tmp_path / "cache")
    assert index.dev == {"q4": {5: 1}}
    with pytest.raises(DataError, match=r"dev qrels file .*nope\.tsv does not exist"):
        DatasetFiles.resolve(cfg_for(root, dev_qrels="nope.tsv"))
    with pytest.raises(DataError, match=r"qrels/dev\.tsv does not exist"):
        DatasetFiles.resolve(cfg_for(root, dev_split="qrels"))
    with pytest.raises(ValueError, match="dev_split is 'train'"):
        cfg_for(root, dev_qrels="heldout-dev.tsv", dev_split="train")


def test_dev_qrels_errors_name_file_and_line(tmp_path: Path) -> None:
    root = make_beir(tmp_path / "data")
    _write(root / "qrels" / "dev.tsv",
           [HEADER, "q4\td6\t1", "q2\td1\t1", "q4\tnope\t1", "q5\td1\tx"])
    message = error_of(root, tmp_path / "cache")
    assert 'qrels/dev.tsv line 3: query "q2" is also in the train qrels' in message
    assert 'qrels/dev.tsv line 4: unknown document id "nope"' in message
    assert 'qrels/dev.tsv line 5: relevance must be an integer' in message
    assert not (tmp_path / "cache").exists()

