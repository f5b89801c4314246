"""Dataset readers and validation (BEIR JSONL/TSV layout and MS MARCO TSV files).

``validate_dataset`` reads every file once, line by line, before any training work starts.
It collects every problem it finds (each naming the file and its 1-based line number) and
raises a single :class:`DataError` listing them. On success it writes, atomically, two
files to a cache directory:

* ``doc_offsets.npy``: int64 byte offset of each document line in the corpus file (the
  document index is the position of the document in the file);
* ``dataset.json``: the small, validated part of the dataset (:class:`DatasetIndex`):
  the queries used, and the train / dev / test qrels keyed by document index.

:class:`Corpus` gives random access to document texts through the offsets (a memory map)
and seeks on the corpus file, so the corpus text is never held in memory.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import random
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

import numpy as np

from ance_train.config import DataConfig
from ance_train.infra.atomic import atomic_write
from ance_train.protocol.keys import DATASET_INDEX_FILE, DOC_OFFSETS_FILE

logger = logging.getLogger(__name__)
_Parsed = TypeVar("_Parsed")

MAX_ERRORS = 20
"""How many problems a :class:`DataError` lists (all are counted)."""
MAX_NAMED_IDS = 10
"""How many ids a warning names before "…and N more"."""
INDEX_VERSION = 1

_DEFAULT_FILES: dict[str, tuple[str, str, str, str]] = {
    # corpus, queries, train qrels, test qrels (optional)
    "beir": ("corpus.jsonl", "queries.jsonl", "qrels/train.tsv", "qrels/test.tsv"),
    "msmarco": ("collection.tsv", "queries.tsv", "qrels.train.tsv", "qrels.dev.tsv"),
}

Qrels = dict[str, dict[int, int]]
"""Query id → {document index: graded relevance > 0}."""
SPLITS = ("train", "dev", "test")


def is_positive(relevance: int) -> bool:
    """Whether a judgement makes the document a positive of its query: relevance > 0 (graded
    qrels judge non-relevant documents with 0). The one definition of a positive."""
    return relevance > 0


class DataError(ValueError):
    """The dataset is missing, malformed or inconsistent; the message names file and line."""


class _LineError(Exception):
    """One malformed line; the message is completed with the file name and line number."""


class _Problems:
    """Collects problems, keeping the first :data:`MAX_ERRORS` messages and counting all."""

    def __init__(self, root: Path | None) -> None:
        self.root = root
        self.messages: list[str] = []
        self.count = 0

    def add(self, message: str) -> None:
        self.count += 1
        if len(self.messages) < MAX_ERRORS:
            self.messages.append(message)

    def at(self, name: str, line_no: int, message: str) -> None:
        self.add(f"{name} line {line_no}: {message}")

    def raise_if_any(self) -> None:
        if not self.count:
            return
        where = f" in dataset {self.root}" if self.root is not None else ""
        noun = "problem" if self.count == 1 else "problems"
        lines = [f"{self.count} {noun}{where}:"]
        lines += [f"  {message}" for message in self.messages]
        if self.count > len(self.messages):
            lines.append(f"  …and {self.count - len(self.messages)} more")
        raise DataError("\n".join(lines))


def _quote(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


def _display(path: Path, root: Path | None) -> str:
    """The path relative to the dataset directory when it lies inside it, else the full path."""
    if root is not None:
        with contextlib.suppress(ValueError):
            return path.relative_to(root).as_posix()
    return str(path)


def _name_ids(ids: Sequence[str]) -> str:
    named = ", ".join(_quote(i) for i in ids[:MAX_NAMED_IDS])
    if len(ids) > MAX_NAMED_IDS:
        named += f", …and {len(ids) - MAX_NAMED_IDS} more"
    return named


# --------------------------------------------------------------------------- files


@dataclass(frozen=True)
class DatasetFiles:
    """The files of one dataset; ``test_qrels`` is ``None`` when the dataset has no test set.

    For MS MARCO, ``test_qrels`` is the official dev qrels (``qrels.dev.tsv``): the dev split
    of :class:`DatasetIndex` is always carved out of the training queries.
    """

    corpus: Path
    queries: Path
    train_qrels: Path
    test_qrels: Path | None = None
    root: Path | None = None

    @classmethod
    def resolve(cls, cfg: DataConfig) -> DatasetFiles:
        """Apply the format's default names and the config's overrides (relative to
        ``cfg.path``); raise :class:`DataError` naming every missing required file."""
        root = Path(cfg.path)
        if not root.is_dir():
            raise DataError(f"dataset directory {root} does not exist or is not a directory")
        corpus_name, queries_name, train_name, test_name = _DEFAULT_FILES[cfg.format]
        corpus = root / (cfg.corpus_file or corpus_name)
        queries = root / (cfg.queries_file or queries_name)
        train = root / (cfg.train_qrels or train_name)
        test = root / (cfg.test_qrels or test_name)
        problems = _Problems(root)
        for label, path in (("corpus", corpus), ("queries", queries), ("train qrels", train)):
            if not path.is_file():
                problems.add(f"{label} file {path} does not exist")
        has_test = test.is_file()
        if cfg.test_qrels is not None and not has_test:
            problems.add(f"test qrels file {test} does not exist")
        problems.raise_if_any()
        return cls(
            corpus=corpus,
            queries=queries,
            train_qrels=train,
            test_qrels=test if has_test else None,
            root=root,
        )


def _text_kind(path: Path, fmt: str) -> str:
    """``"jsonl"`` or ``"tsv"``: from the file suffix, else from the dataset format."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix in (".tsv", ".txt"):
        return "tsv"
    if fmt in ("jsonl", "tsv"):
        return fmt
    return "jsonl" if fmt == "beir" else "tsv"


# --------------------------------------------------------------------------- line parsing


def _lines(handle: IO[bytes]) -> Iterator[tuple[int, int, bytes]]:
    """(1-based line number, byte offset of the line start, raw line) for each line."""
    offset = 0
    for line_no, raw in enumerate(handle, start=1):
        yield line_no, offset, raw
        offset += len(raw)


def _is_blank(raw: bytes) -> bool:
    return not raw.strip()


def _decode(raw: bytes) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        bad = error.object[error.start : error.start + 1].hex()
        raise _LineError(
            f"not valid UTF-8 ({error.reason}: byte 0x{bad} at byte {error.start + 1})"
        ) from None
    text = text.rstrip("\r\n")
    if text.startswith("\ufeff"):
        text = text[1:]
    return text


def _json_object(raw: bytes) -> dict[str, Any]:
    line = _decode(raw)
    try:
        value = json.loads(line)
    except json.JSONDecodeError as error:
        raise _LineError(f"invalid JSON: {error.msg} (column {error.colno})") from None
    if not isinstance(value, dict):
        raise _LineError(f"expected a JSON object, found {type(value).__name__}")
    return value


def _json_str(obj: dict[str, Any], key: str, required: bool = True) -> str:
    if key not in obj or obj[key] is None:
        if required:
            raise _LineError(f'missing field "{key}"')
        return ""
    value = obj[key]
    if not isinstance(value, str):
        raise _LineError(f'field "{key}" must be a string, found {type(value).__name__}')
    return value


def _tsv(raw: bytes, columns: str) -> list[str]:
    parts = _decode(raw).split("\t")
    expected = columns.count("\t") + 1
    if len(parts) != expected:
        raise _LineError(
            f"expected {expected} tab-separated columns ({columns.replace(chr(9), ', ')}), "
            f"found {len(parts)}"
        )
    return parts


def _check_id(value: str, what: str) -> str:
    if not value.strip():
        raise _LineError(f"empty {what} id")
    return value


def _parse_doc(raw: bytes, kind: str) -> tuple[str, str, str]:
    """(doc id, title, text) of one corpus line."""
    if kind == "jsonl":
        obj = _json_object(raw)
        doc_id = _check_id(_json_str(obj, "_id"), "document")
        return doc_id, _json_str(obj, "title", required=False), _json_str(obj, "text")
    pid, text = _tsv(raw, "pid\ttext")
    return _check_id(pid.strip(), "document"), "", text


def _parse_query(raw: bytes, kind: str) -> tuple[str, str]:
    """(query id, text) of one queries line."""
    if kind == "jsonl":
        obj = _json_object(raw)
        return _check_id(_json_str(obj, "_id"), "query"), _json_str(obj, "text")
    qid, text = _tsv(raw, "qid\ttext")
    return _check_id(qid.strip(), "query"), text


def doc_text(title: str, text: str) -> str:
    """The text to encode: ``title + " " + text`` (stripped parts; title left out if empty)."""
    title, text = title.strip(), text.strip()
    if title and text:
        return f"{title} {text}"
    return title or text


def _int(value: str) -> int | None:
    try:
        return int(value)
    except ValueError:
        return None


# --------------------------------------------------------------------------- corpus


class Corpus:
    """Random access to the documents of a validated corpus file.

    Holds an open binary file handle and a read-only memory map of the offsets, so it is
    cheap to open in every process and its memory does not grow with the corpus. Pickling
    drops the handles; they are reopened on first use.
    """

    def __init__(self, files: DatasetFiles, offsets_path: Path, fmt: str) -> None:
        self.path = Path(files.corpus)
        self.offsets_path = Path(offsets_path)
        self.fmt = fmt
        self.kind = _text_kind(self.path, fmt)
        self._offsets: np.ndarray | None = None
        self._handle: IO[bytes] | None = None
        self._open()

    def _open(self) -> None:
        try:
            offsets = np.load(self.offsets_path, mmap_mode="r")
        except (OSError, ValueError) as error:
            raise DataError(f"cannot read document offsets {self.offsets_path}: {error}") from None
        if offsets.ndim != 1 or offsets.dtype != np.int64:
            raise DataError(f"{self.offsets_path}: expected a 1-d int64 array of offsets")
        size = self.path.stat().st_size
        if len(offsets) and int(offsets[-1]) >= size:
            raise DataError(
                f"{self.offsets_path} does not match {self.path} (the corpus file changed "
                "since validation; validate the dataset again)"
            )
        self._offsets = offsets
        self._handle = open(self.path, "rb")  # noqa: SIM115 - closed in close()

    @property
    def offsets(self) -> np.ndarray:
        if self._offsets is None:
            self._open()
        assert self._offsets is not None
        return self._offsets

    @property
    def _file(self) -> IO[bytes]:
        if self._handle is None:
            self._open()
        assert self._handle is not None
        return self._handle

    def __len__(self) -> int:
        return len(self.offsets)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_offsets"] = None
        state["_handle"] = None
        return state

    def close(self) -> None:
        """Close the file handle and drop the memory map."""
        if self._handle is not None:
            self._handle.close()
        self._handle = None
        self._offsets = None

    def __enter__(self) -> Corpus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self, i: int) -> int:
        n = len(self)
        index = int(i)
        if not 0 <= index < n:
            raise IndexError(f"document index {i} out of range (corpus has {n} documents)")
        return index

    def _doc_at(self, index: int) -> tuple[str, str, str]:
        handle = self._file
        handle.seek(int(self.offsets[index]))
        raw = handle.readline()
        try:
            return _parse_doc(raw, self.kind)
        except _LineError as error:
            raise DataError(
                f"{self.path} (document {index}): {error}; the corpus file changed since validation"
            ) from None

    def doc_id(self, i: int) -> str:
        """The id of document ``i`` (its position in the corpus file)."""
        return self._doc_at(self._check(i))[0]

    def text(self, i: int) -> str:
        """The text to encode for document ``i`` (see :func:`doc_text`)."""
        _, title, text = self._doc_at(self._check(i))
        return doc_text(title, text)

    def texts(self, indices: Sequence[int]) -> list[str]:
        """Texts of ``indices``, in the given order (read in file order to limit seeking)."""
        checked = [self._check(i) for i in indices]
        result: list[str] = [""] * len(checked)
        for position in sorted(range(len(checked)), key=checked.__getitem__):
            _, title, text = self._doc_at(checked[position])
            result[position] = doc_text(title, text)
        return result

    def iter_range(self, start: int, stop: int) -> Iterator[tuple[str, str]]:
        """(doc id, text) of documents ``start`` to ``stop - 1``, read sequentially."""
        n = len(self)
        stop = min(stop, n)
        if start < 0 or start > n:
            raise IndexError(f"start {start} out of range (corpus has {n} documents)")
        if start >= stop:
            return
        position = int(self.offsets[start])
        index = start
        while index < stop:
            # Seek every time: the handle is shared with text()/texts() between yields.
            handle = self._file
            handle.seek(position)
            raw = handle.readline()
            position += len(raw)
            if not raw:
                raise DataError(f"{self.path}: ended before document {index}; validate again")
            if _is_blank(raw):
                continue
            try:
                doc_id, title, text = _parse_doc(raw, self.kind)
            except _LineError as error:
                raise DataError(f"{self.path} (document {index}): {error}") from None
            yield doc_id, doc_text(title, text)
            index += 1


def shard_ranges(num_items: int, shard_size: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` ranges of at most ``shard_size`` items covering all."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be at least 1, got {shard_size}")
    if num_items < 0:
        raise ValueError(f"num_items must not be negative, got {num_items}")
    return [(s, min(s + shard_size, num_items)) for s in range(0, num_items, shard_size)]


# --------------------------------------------------------------------------- index


@dataclass
class DatasetIndex:
    """The validated, small part of a dataset (JSON-serialisable).

    ``train``/``dev``/``test`` map a query id to ``{document index: relevance}`` with only
    positive relevance; a query appears in a split only if it has at least one positive.
    ``queries`` holds the texts of the queries used in any split.
    """

    format: str
    num_docs: int
    queries: dict[str, str] = field(default_factory=dict)
    train: Qrels = field(default_factory=dict)
    dev: Qrels = field(default_factory=dict)
    test: Qrels = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    empty_doc_count: int = 0

    def positives(self, query_id: str, split: str = "train") -> list[int]:
        """The positives of ``query_id`` in ``split``: its documents judged with
        :func:`is_positive` relevance, sorted (KeyError when the query is not in the split)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}: expected one of {', '.join(SPLITS)}")
        judged: Qrels = getattr(self, split)
        return sorted(doc for doc, rel in judged[query_id].items() if is_positive(rel))

    def to_json(self) -> str:
        def split(qrels: Qrels) -> dict[str, dict[str, int]]:
            return {q: {str(d): r for d, r in docs.items()} for q, docs in qrels.items()}

        return json.dumps(
            {
                "version": INDEX_VERSION,
                "format": self.format,
                "num_docs": self.num_docs,
                "empty_doc_count": self.empty_doc_count,
                "warnings": self.warnings,
                "queries": self.queries,
                "train": split(self.train),
                "dev": split(self.dev),
                "test": split(self.test),
            },
            ensure_ascii=False,
        )

    @classmethod
    def from_json(cls, text: str) -> DatasetIndex:
        raw = json.loads(text)

        def split(value: dict[str, dict[str, int]]) -> Qrels:
            return {q: {int(d): int(r) for d, r in docs.items()} for q, docs in value.items()}

        return cls(
            format=raw["format"],
            num_docs=int(raw["num_docs"]),
            queries=dict(raw.get("queries", {})),
            train=split(raw.get("train", {})),
            dev=split(raw.get("dev", {})),
            test=split(raw.get("test", {})),
            warnings=list(raw.get("warnings", [])),
            empty_doc_count=int(raw.get("empty_doc_count", 0)),
        )


def load_dataset_index(cache_dir: str | Path) -> DatasetIndex:
    """Read ``cache_dir/dataset.json`` written by :func:`validate_dataset`."""
    path = Path(cache_dir) / DATASET_INDEX_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise DataError(f"cannot read dataset index {path}: {error.strerror}") from None
    try:
        return DatasetIndex.from_json(text)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise DataError(f"{path}: not a valid dataset index ({error})") from None


# --------------------------------------------------------------------------- validation


def _parsed_lines(path: Path, parse: Callable[[bytes], _Parsed], name: str,
                  problems: _Problems) -> Iterator[tuple[int, int, _Parsed]]:
    """(1-based line number, byte offset, ``parse(line)``) of each non-blank line of ``path``;
    a line that ``parse`` rejects is recorded in ``problems`` and skipped."""
    with open(path, "rb") as handle:
        for line_no, offset, raw in _lines(handle):
            if _is_blank(raw):
                continue
            try:
                parsed = parse(raw)
            except _LineError as error:
                problems.at(name, line_no, str(error))
                continue
            yield line_no, offset, parsed


@dataclass
class _CorpusScan:
    doc_index: dict[str, int]
    offsets: array
    empty_ids: list[str]


def _scan_corpus(path: Path, kind: str, name: str, problems: _Problems) -> _CorpusScan:
    doc_index: dict[str, int] = {}
    first_line = array("q")  # line number of each document, for duplicate messages
    offsets = array("q")
    empty_ids: list[str] = []
    parse = functools.partial(_parse_doc, kind=kind)
    for line_no, offset, (doc_id, title, text) in _parsed_lines(path, parse, name, problems):
        seen = doc_index.get(doc_id)
        if seen is not None:
            problems.at(
                name,
                line_no,
                f"duplicate document id {_quote(doc_id)} (first seen on line "
                f"{first_line[seen]})",
            )
            continue
        doc_index[doc_id] = len(offsets)
        offsets.append(offset)
        first_line.append(line_no)
        if not title.strip() and not text.strip():
            empty_ids.append(doc_id)
    if not offsets and not problems.count:
        problems.add(f"{name}: the corpus has no documents")
    return _CorpusScan(doc_index, offsets, empty_ids)


def _scan_queries(
    path: Path, kind: str, name: str, problems: _Problems
) -> tuple[dict[str, str], list[str]]:
    queries: dict[str, str] = {}
    first_line: dict[str, int] = {}
    empty_ids: list[str] = []
    parse = functools.partial(_parse_query, kind=kind)
    for line_no, _, (qid, text) in _parsed_lines(path, parse, name, problems):
        if qid in first_line:
            problems.at(
                name,
                line_no,
                f"duplicate query id {_quote(qid)} (first seen on line {first_line[qid]})",
            )
            continue
        first_line[qid] = line_no
        queries[qid] = text
        if not text.strip():
            empty_ids.append(qid)
    return queries, empty_ids


def _scan_qrels(
    path: Path,
    name: str,
    doc_index: dict[str, int],
    queries: dict[str, str],
    problems: _Problems,
    warnings: list[str],
) -> Qrels:
    """Positive qrels of one file, keyed by document index, in order of first appearance."""
    qrels: Qrels = {}
    first_line: dict[tuple[str, int], tuple[int, int]] = {}
    columns = 0  # 3 (BEIR: query-id, corpus-id, score) or 4 (TREC: qid, 0, pid, rel)
    duplicates = 0
    first = True
    with open(path, "rb") as handle:
        for line_no, _, raw in _lines(handle):
            if _is_blank(raw):
                continue
            is_first, first = first, False
            try:
                line = _decode(raw)
            except _LineError as error:
                problems.at(name, line_no, str(error))
                continue
            parts = [p.strip() for p in line.split("\t")] if "\t" in line else line.split()
            if not columns and len(parts) in (3, 4):
                columns = len(parts)
            if is_first and len(parts) == columns and _int(parts[-1]) is None:
                continue  # header line
            if len(parts) != columns:
                expected = (
                    str(columns) if columns else "3 (qid, docid, rel) or 4 (qid, 0, docid, rel)"
                )
                problems.at(name, line_no, f"expected {expected} columns, found {len(parts)}")
                continue
            qid, did, score = parts[0], parts[-2], parts[-1]
            rel = _int(score)
            if rel is None:
                problems.at(name, line_no, f"relevance must be an integer, found {_quote(score)}")
                continue
            bad = False
            if qid not in queries:
                problems.at(name, line_no, f"unknown query id {_quote(qid)}")
                bad = True
            index = doc_index.get(did)
            if index is None:
                problems.at(name, line_no, f"unknown document id {_quote(did)}")
                bad = True
            if bad or index is None:
                continue
            previous = first_line.get((qid, index))
            if previous is not None:
                seen_line, seen_rel = previous
                if seen_rel != rel:
                    problems.at(
                        name,
                        line_no,
                        f"query {_quote(qid)} document {_quote(did)} has relevance {rel} but "
                        f"{seen_rel} on line {seen_line}",
                    )
                else:
                    duplicates += 1
                continue
            first_line[(qid, index)] = (line_no, rel)
            if is_positive(rel):
                qrels.setdefault(qid, {})[index] = rel
    if duplicates:
        noun = "judgement" if duplicates == 1 else "judgements"
        warnings.append(f"{name}: {duplicates} repeated {noun} ignored")
    return qrels


def _split_train(train: Qrels, cfg: DataConfig, seed: int) -> tuple[Qrels, Qrels]:
    """Hold out the dev queries and cap the train queries, deterministically."""
    order = sorted(train)
    random.Random(seed).shuffle(order)
    n_dev = min(round(cfg.dev_fraction * len(order)), cfg.dev_max_queries, len(order) - 1)
    n_dev = max(n_dev, 0)
    dev_ids = set(order[:n_dev])
    train_ids = order[n_dev:]
    if cfg.max_train_queries is not None:
        train_ids = train_ids[: cfg.max_train_queries]
    keep = set(train_ids)
    return (
        {q: docs for q, docs in train.items() if q in keep},
        {q: docs for q, docs in train.items() if q in dev_ids},
    )


def validate_dataset(cfg: DataConfig, cache_dir: str | Path, seed: int = 42) -> DatasetIndex:
    """Validate the dataset of ``cfg``, write ``doc_offsets.npy`` and ``dataset.json`` to
    ``cache_dir`` (atomically, only on success) and return the index.

    Raises :class:`DataError` listing up to :data:`MAX_ERRORS` problems, each naming the file
    and line. Empty documents and queries are legal and reported as warnings.
    """
    files = DatasetFiles.resolve(cfg)
    root = files.root
    problems = _Problems(root)
    warnings: list[str] = []

    corpus_name = _display(files.corpus, root)
    scan = _scan_corpus(files.corpus, _text_kind(files.corpus, cfg.format), corpus_name, problems)
    queries_name = _display(files.queries, root)
    queries, empty_queries = _scan_queries(
        files.queries, _text_kind(files.queries, cfg.format), queries_name, problems
    )

    if scan.empty_ids:
        n = len(scan.empty_ids)
        warnings.append(
            f"{corpus_name}: {n} {'document has' if n == 1 else 'documents have'} empty text: "
            f"{_name_ids(scan.empty_ids)}"
        )
    if empty_queries:
        n = len(empty_queries)
        warnings.append(
            f"{queries_name}: {n} {'query has' if n == 1 else 'queries have'} empty text: "
            f"{_name_ids(empty_queries)}"
        )

    train_name = _display(files.train_qrels, root)
    train_all = _scan_qrels(
        files.train_qrels, train_name, scan.doc_index, queries, problems, warnings
    )
    test: Qrels = {}
    if files.test_qrels is not None:
        test = _scan_qrels(
            files.test_qrels,
            _display(files.test_qrels, root),
            scan.doc_index,
            queries,
            problems,
            warnings,
        )
    if not train_all and not problems.count:
        problems.add(f"{train_name}: no training judgements with relevance > 0")
    problems.raise_if_any()
    scan.doc_index = {}  # the only per-document structure; not needed any more

    overlap = sorted(set(train_all) & set(test))
    if overlap:
        warnings.append(
            f"{len(overlap)} queries are in both the train and test qrels: {_name_ids(overlap)}"
        )
    train, dev = _split_train(train_all, cfg, seed)
    used = set(train) | set(dev) | set(test)
    index = DatasetIndex(
        format=cfg.format,
        num_docs=len(scan.offsets),
        queries={q: t for q, t in queries.items() if q in used},
        train=train,
        dev=dev,
        test=test,
        warnings=warnings,
        empty_doc_count=len(scan.empty_ids),
    )
    for warning in warnings:
        logger.warning(warning)

    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    offsets = np.frombuffer(scan.offsets, dtype=np.int64)
    atomic_write(cache / DOC_OFFSETS_FILE, lambda handle: np.save(handle, offsets))
    payload = index.to_json().encode("utf-8")
    atomic_write(cache / DATASET_INDEX_FILE, lambda handle: handle.write(payload))
    return index


def open_corpus(cfg: DataConfig, cache_dir: str | Path) -> Corpus:
    """A :class:`Corpus` over the validated dataset of ``cfg`` (offsets from ``cache_dir``)."""
    return Corpus(DatasetFiles.resolve(cfg), Path(cache_dir) / DOC_OFFSETS_FILE, cfg.format)
