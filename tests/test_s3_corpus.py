"""A dataset in a bucket (``data.path: s3://bucket/prefix/``), against a real S3 server (moto,
a separate OS process on loopback) through the minio client: the URL's parsing, validation
streaming each object once, byte-range reads equal to the local corpus byte for byte,
errors naming the ``s3://`` URL and line, and a stream resumed after a cut connection."""

from __future__ import annotations

import json
import pickle
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
from minio import Minio

from ance_train.config import ConfigError, DataConfig, S3Url, load_config, parse_config
from ance_train.data import corpus as corpus_module
from ance_train.data import source
from ance_train.data.corpus import Corpus, open_corpus
from ance_train.data.formats import DatasetFiles
from ance_train.data.problems import DataError
from ance_train.data.validation import validate_dataset
from ance_train.protocol.keys import DATASET_INDEX_FILE, DOC_OFFSETS_FILE
from ance_train.protocol.work import shard_ranges

from ance_train_dev.tcp_proxy import TcpProxy

HEADER = "query-id\tcorpus-id\tscore"


def _doc(doc_id: str, text: str, title: str = "T") -> str:
    return json.dumps({"_id": doc_id, "title": title, "text": text}, ensure_ascii=False)


def beir_files() -> dict[str, bytes]:
    """A BEIR dataset whose corpus has what a byte-range reader could get wrong: a BOM, multi-
    byte UTF-8 (accents, CJK, an emoji), blank lines, a CRLF line, and a last line without a
    newline."""
    docs = [_doc("d1", "Vitamin D and bone density"),
            _doc("d2", "Café crème — naïve façade", title="Français"),
            _doc("d3", "维生素D与骨密度 🦴", title="中文"),
            _doc("d4", "tabs\tand \\n escapes", title=""),
            _doc("d5", "after a CRLF line"),
            _doc("d6", "the last line has no newline")]
    corpus = ("\ufeff" + docs[0] + "\n" + docs[1] + "\n\n  \n" + docs[2] + "\n" + docs[3]
              + "\r\n" + docs[4] + "\n" + docs[5]).encode("utf-8")
    queries = "".join(json.dumps({"_id": f"q{i}", "text": f"query {i} ü"}, ensure_ascii=False)
                      + "\n" for i in range(1, 6)).encode("utf-8")
    train = "\n".join([HEADER, "q1\td1\t1", "q2\td2\t1", "q3\td3\t2", "q4\td4\t1"]) + "\n"
    return {"corpus.jsonl": corpus, "queries.jsonl": queries,
            "qrels/train.tsv": train.encode(), "qrels/test.tsv": f"{HEADER}\nq5\td6\t1".encode()}


def msmarco_files() -> dict[str, bytes]:
    collection = "0\tprimera línea\n1\t第二\n\n2\tthird passage\n3\tno newline at the end"
    return {"collection.tsv": collection.encode("utf-8"),
            "queries.tsv": "10\twhat is one\n11\twhat is two ✓\n12\tthree\n".encode(),
            "qrels.train.tsv": b"10\t0\t0\t1\n11\t0\t1\t1\n12\t0\t3\t1\n",
            "qrels.dev.tsv": b"12\t0\t2\t1\n"}


def minio_client(env: dict[str, str]) -> Minio:
    return Minio(env["ANCE_S3_ENDPOINT"], access_key=env["ANCE_S3_ACCESS_KEY"],
                 secret_key=env["ANCE_S3_SECRET_KEY"], secure=False)


def upload(env: dict[str, str], files: dict[str, bytes], prefix: str = "datasets/x/"
           ) -> S3Url:
    """Put ``files`` under ``prefix`` of a new bucket; the bucket's ``s3://`` prefix."""
    import io

    client = minio_client(env)
    bucket = f"data-{uuid.uuid4().hex[:12]}"
    client.make_bucket(bucket)
    for name, data in files.items():
        client.put_object(bucket, prefix + name, io.BytesIO(data), len(data))
    return S3Url(bucket, prefix)


def write_local(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch, s3_env: dict[str, str]) -> dict[str, str]:
    """The run's S3 settings in the environment (as a service has them)."""
    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    return s3_env


class GetCounter:
    """Counts the GETs of the data readers (wraps the real client's ``get_object``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, url: S3Url) -> None:
        self.calls: list[tuple[int, int]] = []
        minio = source.reader(url).client.minio
        real = minio.get_object

        def counted(bucket: str, key: str, offset: int = 0, length: int = 0, **kw):
            self.calls.append((offset, length))
            return real(bucket, key, offset=offset, length=length, **kw)

        monkeypatch.setattr(minio, "get_object", counted)


# --------------------------------------------------------------------------- the URL


@pytest.mark.parametrize(("path", "bucket", "key"), [
    ("s3://bkt/datasets/scifact/", "bkt", "datasets/scifact/"),
    ("s3://bkt/datasets/scifact", "bkt", "datasets/scifact/"),  # a prefix is a directory
    ("s3://my.data-bucket", "my.data-bucket", ""),
    ("s3://bkt/", "bkt", ""),
])
def test_s3_path_is_parsed_into_bucket_and_prefix(path: str, bucket: str, key: str) -> None:
    cfg = DataConfig(path=path)
    assert cfg.s3 == S3Url(bucket, key)
    assert cfg.path == f"s3://{bucket}/{key}"
    assert str(cfg.s3.child("qrels/train.tsv")) == f"s3://{bucket}/{key}qrels/train.tsv"
    assert DataConfig(path="/srv/data").s3 is None


@pytest.mark.parametrize(("path", "says"), [
    ("s3://", "names no bucket"),
    ("s3:///datasets", "names no bucket"),
    ("s3://Upper_Case/x", "invalid bucket name 'Upper_Case'"),
    ("s3://ab/x", "invalid bucket name 'ab'"),
    ("s3://key:secret@bkt/x", "may hold no user, port"),
    ("s3://bkt:9000/x", "may hold no user, port"),
    ("s3://bkt/a//b/", "empty, '.' or '..' path segments"),
    ("s3://bkt/a/../b/", "empty, '.' or '..' path segments"),
    ("s3://bkt/x?versionId=1", "'?' or '#'"),
    ("gs://bkt/x", "unsupported URL scheme 'gs'"),
    ("https://bkt.example/x", "unsupported URL scheme 'https'"),
])
def test_malformed_s3_path_is_refused_naming_the_field(path: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"data": {"path": path}}, "run.yaml")
    message = str(info.value)
    assert "data.path" in message and says in message, message


def test_file_names_must_stay_under_the_prefix() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"data": {"path": "s3://bkt/d/", "corpus_file": "../other/c.jsonl"}})
    assert "data" in str(info.value) and "corpus_file" in str(info.value)
    cfg = DataConfig(path="s3://bkt/d/", corpus_file="docs/c.jsonl")
    assert DataConfig.model_validate(cfg.model_dump()).s3 == S3Url("bkt", "d/")


def test_config_file_keeps_an_s3_path_as_written(tmp_path: Path) -> None:
    """A relative directory is resolved against the config file; an s3:// URL is not."""
    (tmp_path / "run.yaml").write_text("data:\n  path: s3://bkt/datasets/scifact\n")
    assert load_config(tmp_path / "run.yaml").data.path == "s3://bkt/datasets/scifact/"


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(("fmt", "files"), [("beir", beir_files()),
                                             ("msmarco", msmarco_files())])
def test_validation_of_a_bucket_writes_what_the_local_copy_gives(
        tmp_path: Path, s3: dict[str, str], monkeypatch: pytest.MonkeyPatch, fmt: str,
        files: dict[str, bytes]) -> None:
    url = upload(s3, files)
    local = write_local(tmp_path / "local", files)
    expected = validate_dataset(DataConfig(path=str(local), format=fmt, dev_fraction=0.0),
                                tmp_path / "local-cache")
    gets = GetCounter(monkeypatch, url)
    index = validate_dataset(DataConfig(path=str(url), format=fmt, dev_fraction=0.0),
                             tmp_path / "s3-cache")
    assert index == expected and index.num_docs == (6 if fmt == "beir" else 4)
    for name in (DOC_OFFSETS_FILE, DATASET_INDEX_FILE):
        assert (tmp_path / "s3-cache" / name).read_bytes() == \
            (tmp_path / "local-cache" / name).read_bytes(), name
    assert len(gets.calls) == len(files)  # each object streamed once, in one GET
    assert all(call == (0, 0) for call in gets.calls)  # whole objects, not ranges


@pytest.mark.parametrize(("fmt", "files"), [("beir", beir_files()),
                                             ("msmarco", msmarco_files())])
def test_documents_read_by_byte_range_equal_the_local_corpus_byte_for_byte(
        tmp_path: Path, s3: dict[str, str], monkeypatch: pytest.MonkeyPatch, fmt: str,
        files: dict[str, bytes]) -> None:
    url = upload(s3, files)
    local_cfg = DataConfig(path=str(write_local(tmp_path / "local", files)), format=fmt)
    s3_cfg = DataConfig(path=str(url), format=fmt)
    validate_dataset(s3_cfg, tmp_path / "cache")
    with open_corpus(local_cfg, tmp_path / "cache") as local, \
            open_corpus(s3_cfg, tmp_path / "cache") as remote:
        assert remote.remote and not local.remote
        n = len(local)
        assert len(remote) == n
        everything = list(range(n))
        corpus_name = "corpus.jsonl" if fmt == "beir" else "collection.tsv"
        raw_file = (tmp_path / "local" / corpus_name).read_bytes()
        for i in everything:  # the raw line: what local readline gives, to the byte
            start = int(local.offsets[i])
            local_line = raw_file[start:].split(b"\n", 1)[0]
            remote_line = remote._remote_lines([i])[i]
            assert remote_line.rstrip(b"\n") == local_line, i
        assert remote.doc_ids(everything) == local.doc_ids(everything)
        assert [remote.text(i) for i in everything] == [local.text(i) for i in everything]
        order = [n - 1, 0, 2, 2, n - 2]  # any order, repeats included
        assert remote.texts(order) == local.texts(order)
        for start, stop in shard_ranges(n, 4):
            assert list(remote.iter_range(start, stop)) == list(local.iter_range(start, stop))
        if fmt == "beir":
            assert remote.text(2) == "中文 维生素D与骨密度 🦴"
            assert remote.text(n - 1) == "T the last line has no newline"
        # Pickled (as a worker process gets it) it reopens and reads the same.
        assert pickle.loads(pickle.dumps(remote)).texts(order) == local.texts(order)


def test_a_shard_is_one_ranged_get_and_a_batch_a_few(
        tmp_path: Path, s3: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    docs = [_doc(f"d{i}", f"document number {i} " + "x" * (i % 7) * 30) for i in range(200)]
    files = {**beir_files(), "corpus.jsonl": ("\n".join(docs) + "\n").encode()}
    files["qrels/train.tsv"] = f"{HEADER}\nq1\td1\t1\nq2\td150\t1\n".encode()
    files["qrels/test.tsv"] = f"{HEADER}\nq5\td199\t1\n".encode()
    url = upload(s3, files)
    cfg = DataConfig(path=str(url))
    validate_dataset(cfg, tmp_path / "cache")
    gets = GetCounter(monkeypatch, url)
    with open_corpus(cfg, tmp_path / "cache") as corpus:
        offsets = np.asarray(corpus.offsets)
        texts = [text for _, text in corpus.iter_range(40, 120)]
        assert len(texts) == 80 and texts[0].startswith("T document number 40 ")
        assert gets.calls == [(int(offsets[40]), int(offsets[120] - offsets[40]))]
        gets.calls.clear()
        assert len(list(corpus.iter_range(150, 400))) == 50  # to the end of the object
        assert gets.calls == [(int(offsets[150]), corpus._size - int(offsets[150]))]
        # A batch: neighbours share a GET; far apart documents get their own.
        gets.calls.clear()
        monkeypatch.setattr(corpus_module, "MERGE_GAP", 2000)
        batch = [3, 5, 4, 190, 100, 101]
        assert corpus.texts(batch) == [f"T document number {i} " + "x" * (i % 7) * 30
                                       for i in batch]
        assert len(gets.calls) == 3, gets.calls
        gets.calls.clear()
        monkeypatch.setattr(corpus_module, "MERGE_GAP", 10**9)
        assert corpus.doc_ids(batch) == [f"d{i}" for i in batch]
        assert len(gets.calls) == 1


# --------------------------------------------------------------------------- bad input


def test_missing_objects_and_bucket_are_named(tmp_path: Path, s3: dict[str, str]) -> None:
    files = beir_files()
    del files["qrels/train.tsv"]
    url = upload(s3, files)
    with pytest.raises(DataError) as info:
        validate_dataset(DataConfig(path=str(url)), tmp_path / "cache")
    assert f"train qrels file s3://{url.bucket}/datasets/x/qrels/train.tsv does not exist" in \
        str(info.value)
    assert not (tmp_path / "cache").exists()
    with pytest.raises(DataError, match="the bucket 'no-such-bucket-here' does not exist"):
        validate_dataset(DataConfig(path="s3://no-such-bucket-here/d/"), tmp_path / "cache")


def test_corpus_object_removed_after_validation_is_named(
        tmp_path: Path, s3: dict[str, str]) -> None:
    url = upload(s3, beir_files())
    cfg = DataConfig(path=str(url))
    validate_dataset(cfg, tmp_path / "cache")
    files = DatasetFiles.resolve(cfg)
    minio_client(s3).remove_object(url.bucket, url.key + "corpus.jsonl")
    with pytest.raises(DataError, match=f"s3://{url.bucket}/datasets/x/corpus.jsonl does not"):
        Corpus(files, tmp_path / "cache" / DOC_OFFSETS_FILE, "beir")


def test_malformed_lines_in_the_bucket_are_named_by_url_and_line(
        tmp_path: Path, s3: dict[str, str]) -> None:
    files = beir_files()
    lines = files["corpus.jsonl"].split(b"\n")
    lines[3] = b'{"_id": "d9", "text": '  # line 4 (lines 3 and 4 of the file are blank)
    files["corpus.jsonl"] = b"\n".join(lines)
    files["queries.jsonl"] += b"\xff\xfe not utf-8\n"
    url = upload(s3, files)
    with pytest.raises(DataError) as info:
        validate_dataset(DataConfig(path=str(url)), tmp_path / "cache")
    message = str(info.value)
    base = f"s3://{url.bucket}/datasets/x/"
    assert f"problems in dataset {base}:" in message
    assert f"{base}corpus.jsonl line 4: invalid JSON" in message, message
    assert f"{base}queries.jsonl line 6: not valid UTF-8" in message, message


def test_no_endpoint_configured_is_a_clear_error(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANCE_S3_ENDPOINT", raising=False)
    with pytest.raises(DataError, match="ANCE_S3_ENDPOINT is not set"):
        validate_dataset(DataConfig(path="s3://bkt/d/"), tmp_path / "cache")


# --------------------------------------------------------------------------- outages


def test_a_stream_cut_midway_resumes_where_it_stopped(
        tmp_path: Path, s3: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection reset in the middle of a shard's GET: the reader retries (tenacity) with a
    ranged GET from the byte it had reached, and the documents come out whole and in order."""
    # 12 MB: more than the socket buffers on the way hold, so the cut lands mid-response.
    docs = [_doc(f"d{i}", f"passage {i} " + "y" * 2000) for i in range(6000)]
    files = {**beir_files(), "corpus.jsonl": ("\n".join(docs) + "\n").encode()}
    url = upload(s3, files)
    cfg = DataConfig(path=str(url))
    validate_dataset(cfg, tmp_path / "cache")
    host, port = s3["ANCE_S3_ENDPOINT"].split(":")
    proxy = TcpProxy(host, int(port)).start()
    try:
        monkeypatch.setenv("ANCE_S3_ENDPOINT", proxy.endpoint)
        monkeypatch.setenv("ANCE_S3_RETRY_SECONDS", "20")
        gets = GetCounter(monkeypatch, url)
        with open_corpus(cfg, tmp_path / "cache") as corpus:
            stream = corpus.iter_range(0, len(corpus))
            first = [next(stream) for _ in range(100)]  # the GET is open, 1 MiB buffered
            proxy.cut()
            threading.Timer(1.0, proxy.restore).start()
            rest = list(stream)
    finally:
        proxy.close()
    texts = [text for _, text in first + rest]
    assert texts == [f"T passage {i} " + "y" * 2000 for i in range(6000)]
    assert len(gets.calls) >= 2 and gets.calls[0][0] == 0
    assert gets.calls[-1][0] > 0  # resumed from where it stopped, not from the start


# --------------------------------------------------------------------------- the CLI


def test_prepare_and_validate_commands_read_the_bucket(
        tmp_path: Path, s3: dict[str, str], tiny_model: Path) -> None:
    """`ance-train prepare` (the trainer pod's init container) publishes the index of a
    dataset in a bucket; `ance-train validate` names a bad line by its URL, exit code 1."""
    import os
    import subprocess
    import sys

    from ance_train.infra.store import store_from_env
    from ance_train.protocol.keys import DATASET_INDEX, DOC_OFFSETS

    from ance_train_dev.helpers import write_config

    good = upload(s3, beir_files())
    bad_files = beir_files()
    bad_files["qrels/train.tsv"] += b"q1\td404\t1\n"
    bad = upload(s3, bad_files)
    env = {**os.environ, **s3}
    results = {}
    for name, url, command in (("good", good, "prepare"), ("bad", bad, "validate")):
        config = write_config(tmp_path / f"{name}.yaml", run_id=f"prep-{good.bucket}",
                              data={"path": str(url), "dev_fraction": 0.0},
                              model={"path": str(tiny_model)})
        results[name] = subprocess.run(
            [sys.executable, "-m", "ance_train.cli", command, "--config", str(config)],
            capture_output=True, text=True, env=env, timeout=120)
    assert results["good"].returncode == 0, results["good"].stderr
    assert "6 docs" in results["good"].stdout
    expected = validate_dataset(DataConfig(path=str(good), dev_fraction=0.0), tmp_path / "c")
    assert expected.num_docs == 6
    store = store_from_env(f"prep-{good.bucket}")
    assert store.get_bytes(DATASET_INDEX) == (tmp_path / "c" / DATASET_INDEX_FILE).read_bytes()
    assert store.get_bytes(DOC_OFFSETS) == (tmp_path / "c" / DOC_OFFSETS_FILE).read_bytes()
    assert results["bad"].returncode == 1
    assert f"s3://{bad.bucket}/datasets/x/qrels/train.tsv line 6: unknown document id " \
           '"d404"' in " ".join(results["bad"].stderr.split()), results["bad"].stderr
