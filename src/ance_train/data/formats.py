"""How each dataset format's files are found and their lines read: BEIR JSONL/TSV and MS MARCO
TSV. Parsing one line raises :class:`LineError`; the caller adds the file and line number."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ance_train.config import DataConfig, S3Url
from ance_train.data import source
from ance_train.data.problems import Problems
from ance_train.data.source import DataFile

DEFAULT_FILES: dict[str, tuple[str, str, str, str]] = {
    # corpus, queries, train qrels, test qrels (optional)
    "beir": ("corpus.jsonl", "queries.jsonl", "qrels/train.tsv", "qrels/test.tsv"),
    "msmarco": ("collection.tsv", "queries.tsv", "qrels.train.tsv", "qrels.dev.tsv"),
}
DEFAULT_DEV_FILES: dict[str, str | None] = {
    # The official dev qrels, used as the dev split when present (``data.dev_split: auto``).
    # MS MARCO's qrels.dev.tsv is its test split here, so it has no default dev file.
    "beir": "qrels/dev.tsv",
    "msmarco": None,
}


class LineError(Exception):
    """One malformed line; the message is completed with the file name and line number."""


@dataclass(frozen=True)
class DatasetFiles:
    """The files of one dataset; ``test_qrels`` is ``None`` when the dataset has no test set,
    ``dev_qrels`` when the dev split is cut from the training queries (``data.dev_split``).

    Each file is a local path, or an object (:class:`S3Url`) when ``data.path`` is
    ``s3://bucket/prefix/`` (read through ``data/source.py``).

    For MS MARCO, ``test_qrels`` is the official dev qrels (``qrels.dev.tsv``): the dev split
    of :class:`DatasetIndex` is carved out of the training queries unless ``data.dev_qrels``
    names another file.
    """

    corpus: DataFile
    queries: DataFile
    train_qrels: DataFile
    test_qrels: DataFile | None = None
    root: DataFile | None = None
    dev_qrels: DataFile | None = None

    @classmethod
    def resolve(cls, cfg: DataConfig) -> DatasetFiles:
        """Apply the format's default names and the config's overrides (relative to
        ``cfg.path``); raise :class:`DataError` naming every missing required file."""
        root: DataFile = cfg.s3 if cfg.s3 is not None else Path(cfg.path)
        source.check_root(root)

        def under(name: str) -> DataFile:
            return root.child(name) if isinstance(root, S3Url) else root / name

        corpus_name, queries_name, train_name, test_name = DEFAULT_FILES[cfg.format]
        corpus = under(cfg.corpus_file or corpus_name)
        queries = under(cfg.queries_file or queries_name)
        train = under(cfg.train_qrels or train_name)
        test = under(cfg.test_qrels or test_name)
        problems = Problems(root)
        for label, path in (("corpus", corpus), ("queries", queries), ("train qrels", train)):
            if not source.exists(path):
                problems.add(f"{label} file {path} does not exist")
        has_test = source.exists(test)
        if cfg.test_qrels is not None and not has_test:
            problems.add(f"test qrels file {test} does not exist")
        dev: DataFile | None = None
        dev_name = cfg.dev_qrels or DEFAULT_DEV_FILES[cfg.format]
        if cfg.dev_split != "train" and dev_name is not None:
            dev = under(dev_name)
            if not source.exists(dev):
                if cfg.dev_qrels is not None or cfg.dev_split == "qrels":
                    problems.add(f"dev qrels file {dev} does not exist (data.dev_split: "
                                 f"{cfg.dev_split})")
                dev = None
        elif cfg.dev_split == "qrels":
            problems.add(f"data.dev_split is 'qrels' but the {cfg.format} format has no "
                         "default dev qrels file: set data.dev_qrels")
        if dev is not None and dev in (train, test):
            problems.add(f"dev qrels file {dev} is also the "
                         f"{'train' if dev == train else 'test'} qrels file")
        problems.raise_if_any()
        return cls(
            corpus=corpus,
            queries=queries,
            train_qrels=train,
            test_qrels=test if has_test else None,
            root=root,
            dev_qrels=dev,
        )


def text_kind(path: DataFile, fmt: str) -> str:
    """``"jsonl"`` or ``"tsv"``: from the file suffix, else from the dataset format."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix in (".tsv", ".txt"):
        return "tsv"
    if fmt in ("jsonl", "tsv"):
        return fmt
    return "jsonl" if fmt == "beir" else "tsv"


def numbered_lines(handle: IO[bytes]) -> Iterator[tuple[int, int, bytes]]:
    """(1-based line number, byte offset of the line start, raw line) for each line."""
    offset = 0
    for line_no, raw in enumerate(handle, start=1):
        yield line_no, offset, raw
        offset += len(raw)


def is_blank(raw: bytes) -> bool:
    return not raw.strip()


def decode_line(raw: bytes) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        bad = error.object[error.start : error.start + 1].hex()
        raise LineError(
            f"not valid UTF-8 ({error.reason}: byte 0x{bad} at byte {error.start + 1})"
        ) from None
    text = text.rstrip("\r\n")
    if text.startswith("\ufeff"):
        text = text[1:]
    return text


def json_object(raw: bytes) -> dict[str, Any]:
    line = decode_line(raw)
    try:
        value = json.loads(line)
    except json.JSONDecodeError as error:
        raise LineError(f"invalid JSON: {error.msg} (column {error.colno})") from None
    if not isinstance(value, dict):
        raise LineError(f"expected a JSON object, found {type(value).__name__}")
    return value


def json_str(obj: dict[str, Any], key: str, required: bool = True) -> str:
    if key not in obj or obj[key] is None:
        if required:
            raise LineError(f'missing field "{key}"')
        return ""
    value = obj[key]
    if not isinstance(value, str):
        raise LineError(f'field "{key}" must be a string, found {type(value).__name__}')
    return value


def tsv_fields(raw: bytes, columns: str) -> list[str]:
    parts = decode_line(raw).split("\t")
    expected = columns.count("\t") + 1
    if len(parts) != expected:
        raise LineError(
            f"expected {expected} tab-separated columns ({columns.replace(chr(9), ', ')}), "
            f"found {len(parts)}"
        )
    return parts


def check_id(value: str, what: str) -> str:
    if not value.strip():
        raise LineError(f"empty {what} id")
    return value


def parse_doc(raw: bytes, kind: str) -> tuple[str, str, str]:
    """(doc id, title, text) of one corpus line."""
    if kind == "jsonl":
        obj = json_object(raw)
        doc_id = check_id(json_str(obj, "_id"), "document")
        return doc_id, json_str(obj, "title", required=False), json_str(obj, "text")
    pid, text = tsv_fields(raw, "pid\ttext")
    return check_id(pid.strip(), "document"), "", text


def parse_query(raw: bytes, kind: str) -> tuple[str, str]:
    """(query id, text) of one queries line."""
    if kind == "jsonl":
        obj = json_object(raw)
        return check_id(json_str(obj, "_id"), "query"), json_str(obj, "text")
    qid, text = tsv_fields(raw, "qid\ttext")
    return check_id(qid.strip(), "query"), text


def doc_text(title: str, text: str) -> str:
    """The text to encode: ``title + " " + text`` (stripped parts; title left out if empty)."""
    title, text = title.strip(), text.strip()
    if title and text:
        return f"{title} {text}"
    return title or text


def parse_int(value: str) -> int | None:
    try:
        return int(value)
    except ValueError:
        return None
