"""``ance-train data convert``: (query, positive[, negative]) pairs into the BEIR layout that
``data.path`` reads.

Sources: a JSONL, CSV/TSV or Parquet file of pairs (sentence-transformers style columns:
``anchor``/``positive``/``negative``, ``query``/``positive``/``negative``, or any two or three
columns, taken in order as sentence-transformers does), and a Hugging Face ``datasets``
folder written by ``save_to_disk`` (its ``train`` / ``validation`` / ``test`` splits).

Identical documents (same text once stripped) become one corpus entry; documents and queries
get ids derived from their text (``d`` / ``q`` + 16 hex digits of its SHA-1), so converting
the same pairs again, in any order, gives the same ids. Negatives become corpus documents
(the trainer mines its own negatives; given ones enlarge the corpus it mines from), never
qrels. Every row dropped is counted by reason with its first locations (:class:`Report`);
an unreadable row is an error naming the file and line (or split and row).
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ance_train.data.problems import DataError
from ance_train.data.staging import staged_directory

QUERY_COLUMNS = ("anchor", "query", "question", "sentence1", "text1")
POSITIVE_COLUMNS = ("positive", "pos", "answer", "document", "passage", "sentence2", "text2")
NEGATIVE_COLUMN = re.compile(r"(negative|neg|hard_negative)(_\d+)?|sentence3|text3")
HF_SPLITS = {"train": "train", "validation": "dev", "dev": "dev", "test": "test"}
EXAMPLES = 3  # locations kept per drop reason
DATASETS_HINT = "install the datasets extra: pip install 'ance-train[datasets]'"


@dataclass(frozen=True)
class Columns:
    query: str
    positive: str
    negatives: tuple[str, ...] = ()

    def describe(self) -> str:
        return (f"query={self.query}, positive={self.positive}"
                + (f", negatives={','.join(self.negatives)}" if self.negatives else ""))


def resolve_columns(names: list[str], where: str, query: str | None = None,
                    positive: str | None = None, negative: str | None = None) -> Columns:
    """Which columns hold the query, the positive(s) and the negative(s): the ones named,
    else the known sentence-transformers names, else (two or three columns) their order."""
    for given in (query, positive, negative):
        if given is not None and given not in names:
            raise DataError(f"{where}: no column {given!r} (columns: {', '.join(names)})")
    lowered = {name.lower(): name for name in names}
    query = query or next((lowered[n] for n in QUERY_COLUMNS if n in lowered), None)
    positive = positive or next((lowered[n] for n in POSITIVE_COLUMNS if n in lowered), None)
    if negative is not None:
        negatives: tuple[str, ...] = (negative,)
    else:
        negatives = tuple(n for n in names if NEGATIVE_COLUMN.fullmatch(n.lower())
                          and n not in (query, positive))
    if query is None or positive is None:
        if 2 <= len(names) <= 3 and query is None and positive is None:
            return Columns(names[0], names[1], tuple(names[2:]))
        raise DataError(f"{where}: cannot tell the query and positive columns among "
                        f"{', '.join(names) or '(none)'}: name them anchor/positive[/negative] "
                        "or query/positive[/negative], or pass --query-column and "
                        "--positive-column")
    return Columns(query, positive, negatives)


Row = tuple[str, dict[str, Any]]
"""(where, the row's columns): ``where`` names the file and line, or the split and row."""


@dataclass
class Source:
    """The rows of one split and the columns they have."""

    name: str  # the file or folder, for messages
    columns: list[str]
    rows: Iterable[Row]


def read_pairs_file(path: Path) -> Source:
    """A JSONL (``.jsonl``/``.json``), CSV (``.csv``), TSV (``.tsv``) or Parquet (``.parquet``)
    file of pairs."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return _jsonl_source(path)
    if suffix in (".csv", ".tsv"):
        return _csv_source(path, "\t" if suffix == ".tsv" else ",")
    if suffix == ".parquet":
        return _parquet_source(path)
    raise DataError(f"{path}: unknown pairs format {suffix or '(no suffix)'}: expected .jsonl, "
                    ".csv, .tsv or .parquet")


def _jsonl_source(path: Path) -> Source:
    def rows() -> Iterator[Row]:
        with open(path, "rb") as handle:
            for line_no, raw in enumerate(handle, start=1):
                if not raw.strip():
                    continue
                where = f"{path} line {line_no}"
                try:
                    value = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as error:
                    raise DataError(f"{where}: invalid JSON ({error})") from None
                if not isinstance(value, dict):
                    raise DataError(f"{where}: expected a JSON object, found "
                                    f"{type(value).__name__}")
                yield where, value

    first = next(iter(rows()), None)
    if first is None:
        raise DataError(f"{path}: no rows")
    return Source(str(path), list(first[1]), rows())


def _csv_source(path: Path, delimiter: str) -> Source:
    try:
        with open(path, newline="", encoding="utf-8-sig") as handle:
            header = next(csv.reader(handle, delimiter=delimiter), None)
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 ({error})") from None
    if not header:
        raise DataError(f"{path}: no header line")

    def rows() -> Iterator[Row]:
        with open(path, newline="", encoding="utf-8-sig") as handle:
            reader = csv.DictReader(handle, delimiter=delimiter, restkey="\0extra")
            try:
                for row in reader:
                    where = f"{path} line {reader.line_num}"
                    if "\0extra" in row:
                        raise DataError(f"{where}: more fields than the header's "
                                        f"{len(header)}")
                    yield where, row
            except (csv.Error, UnicodeDecodeError) as error:
                raise DataError(f"{path} line {reader.line_num}: {error}") from None

    return Source(str(path), header, rows())


def _parquet_source(path: Path) -> Source:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: {DATASETS_HINT}") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow's ArrowInvalid and OSError alike
        raise DataError(f"{path}: not a readable Parquet file ({error})") from None

    def rows() -> Iterator[Row]:
        number = 0
        for batch in parquet.iter_batches(batch_size=4096):
            for row in batch.to_pylist():
                number += 1
                yield f"{path} row {number}", row

    return Source(str(path), list(parquet.schema_arrow.names), rows())


def read_hf_folder(directory: Path) -> dict[str, Source]:
    """The splits (``train``/``dev``/``test``) of a ``datasets`` folder (``save_to_disk``)."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{directory}: reading a Hugging Face datasets folder needs the "
                        f"datasets package: {DATASETS_HINT}") from None
    directory = Path(directory)
    try:
        loaded = datasets.load_from_disk(str(directory))
    except (FileNotFoundError, ValueError, OSError) as error:
        raise DataError(f"{directory}: not a Hugging Face datasets folder written by "
                        f"save_to_disk ({error})") from None
    if isinstance(loaded, datasets.Dataset):
        splits = {"train": loaded}
    else:
        unknown = sorted(set(loaded) - set(HF_SPLITS))
        if unknown:
            raise DataError(f"{directory}: unknown split(s) {', '.join(unknown)}: expected "
                            f"{', '.join(HF_SPLITS)}")
        splits = {name: loaded[name] for name in loaded}
    sources: dict[str, Source] = {}
    for name, split in splits.items():
        target = HF_SPLITS[name]
        if target in sources:
            raise DataError(f"{directory}: two dev splits (dev and validation)")

        def rows(split=split, name=name) -> Iterator[Row]:
            for number, row in enumerate(split, start=1):
                yield f"{directory} split {name} row {number}", row

        sources[target] = Source(f"{directory} split {name}", list(split.column_names), rows())
    return sources


@dataclass
class Report:
    """What a conversion kept and what it dropped (reason → count, first locations)."""

    dropped: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    rows: int = 0
    docs: int = 0
    negative_docs: int = 0  # corpus entries that only ever appear as negatives
    queries: dict[str, int] = field(default_factory=dict)
    qrels: dict[str, int] = field(default_factory=dict)
    columns: dict[str, str] = field(default_factory=dict)

    def drop(self, reason: str, where: str, count: int = 1) -> None:
        self.dropped[reason] += count
        seen = self.examples.setdefault(reason, [])
        if len(seen) < EXAMPLES:
            seen.append(where)

    def lines(self) -> list[str]:
        splits = " / ".join(f"{self.queries.get(s, 0)} {s}" for s in ("train", "dev", "test"))
        out = [f"{self.rows} rows → {self.docs} documents ({self.negative_docs} only as "
               f"negatives), queries {splits}, "
               f"{sum(self.qrels.values())} qrels"]
        for reason, count in sorted(self.dropped.items(), key=lambda item: -item[1]):
            out.append(f"dropped {count}: {reason} (e.g. {'; '.join(self.examples[reason])})")
        return out

    def to_json(self) -> dict[str, Any]:
        return {"rows": self.rows, "docs": self.docs, "negative_docs": self.negative_docs,
                "queries": self.queries, "qrels": self.qrels, "columns": self.columns,
                "dropped": dict(self.dropped), "examples": self.examples}


def text_id(prefix: str, text: str) -> str:
    return prefix + hashlib.sha1(text.encode("utf-8"), usedforsecurity=False).hexdigest()[:16]


class _Builder:
    def __init__(self, report: Report) -> None:
        self.report = report
        self.docs: dict[str, str] = {}  # id → text, in first-seen order
        self.queries: dict[str, str] = {}
        self.qrels: dict[str, dict[str, list[str]]] = {"train": {}, "dev": {}, "test": {}}
        self.positive_docs: set[str] = set()

    def _texts(self, value: Any, column: str, where: str) -> list[str]:
        if value is None:
            return []
        values = value if isinstance(value, list) else [value]
        for item in values:
            if item is not None and not isinstance(item, str):
                raise DataError(f"{where}: column {column!r} must hold text (or a list of "
                                f"texts), found {type(item).__name__}")
        return [item.strip() if item else "" for item in values]

    def _doc(self, text: str) -> str:
        doc_id = text_id("d", text)
        known = self.docs.setdefault(doc_id, text)
        if known != text:
            raise DataError(f"two different documents share the id {doc_id}")
        return doc_id

    def add(self, split: str, source: Source, columns: Columns,
            held_out: dict[str, str]) -> None:
        """The rows of ``source`` into ``split``; a query in ``held_out`` (query id → its
        split) is dropped here."""
        report = self.report
        for where, row in source.rows:
            report.rows += 1
            query = self._texts(row.get(columns.query), columns.query, where)
            if len(query) > 1:
                raise DataError(f"{where}: column {columns.query!r} must hold one text")
            query_text = query[0] if query else ""
            if not query_text:
                report.drop("missing or empty query text", where)
                continue
            positives = self._texts(row.get(columns.positive), columns.positive, where)
            if not any(positives):
                report.drop("missing or empty positive", where)
                continue
            if "" in positives:
                report.drop("empty positive in a list (the others kept)", where,
                            positives.count(""))
            query_id = text_id("q", query_text)
            if query_id in held_out:
                report.drop(f"query also in the {held_out[query_id]} split (kept there "
                            f"only, not in {split})", where)
                continue
            self.queries[query_id] = query_text
            judged = self.qrels[split].setdefault(query_id, [])
            for text in filter(None, positives):
                doc_id = self._doc(text)
                self.positive_docs.add(doc_id)
                if doc_id in judged:
                    report.drop(f"duplicate (query, positive) pair in {split}", where)
                else:
                    judged.append(doc_id)
            for column in columns.negatives:
                for text in self._texts(row.get(column), column, where):
                    if not text:
                        if row.get(column) is not None:
                            report.drop("empty negative text", where)
                        continue
                    if text_id("d", text) in judged:
                        report.drop("negative equal to a positive of its query", where)
                        continue
                    self._doc(text)
            if not judged:
                del self.qrels[split][query_id]

    def hold_out_dev(self, fraction: float, seed: int) -> None:
        """Move ``fraction`` of the training queries (chosen by a hash of seed and id, so the
        same pairs give the same split) to dev."""
        train = self.qrels["train"]
        count = round(len(train) * fraction)
        if fraction > 0 and count == 0 and len(train) > 1:
            count = 1
        ranked = sorted(train, key=lambda q: hashlib.sha1(
            f"{seed}:{q}".encode(), usedforsecurity=False).hexdigest())
        for query_id in ranked[:count]:
            self.qrels["dev"][query_id] = train.pop(query_id)

    def write(self, directory: Path) -> None:
        report = self.report
        if not self.qrels["train"]:
            raise DataError("no training pair left to write" + (
                f" ({', '.join(f'{n} {r}' for r, n in report.dropped.items())})"
                if report.dropped else ""))
        used = {q for split in self.qrels.values() for q in split}
        with open(directory / "corpus.jsonl", "w", encoding="utf-8") as out:
            for doc_id, text in self.docs.items():
                out.write(json.dumps({"_id": doc_id, "title": "", "text": text},
                                     ensure_ascii=False) + "\n")
        with open(directory / "queries.jsonl", "w", encoding="utf-8") as out:
            for query_id, text in self.queries.items():
                if query_id in used:
                    out.write(json.dumps({"_id": query_id, "text": text},
                                         ensure_ascii=False) + "\n")
        (directory / "qrels").mkdir()
        for split, qrels in self.qrels.items():
            if not qrels:
                continue
            with open(directory / "qrels" / f"{split}.tsv", "w", encoding="utf-8") as out:
                out.write("query-id\tcorpus-id\tscore\n")
                for query_id, docs in qrels.items():
                    out.writelines(f"{query_id}\t{doc_id}\t1\n" for doc_id in docs)
            report.queries[split] = len(qrels)
            report.qrels[split] = sum(len(docs) for docs in qrels.values())
        report.docs = len(self.docs)
        report.negative_docs = len(self.docs.keys() - self.positive_docs)
        (directory / "conversion.json").write_text(json.dumps(report.to_json(), indent=2))


@dataclass
class ColumnNames:
    """``--query-column`` / ``--positive-column`` / ``--negative-column`` (None: detect)."""

    query: str | None = None
    positive: str | None = None
    negative: str | None = None


def convert_splits(splits: dict[str, Source], target: Path, names: ColumnNames | None = None,
                   dev_fraction: float = 0.0, seed: int = 42) -> Report:
    """Write the BEIR layout of ``splits`` (``train`` required; ``dev``, ``test`` optional)
    into ``target`` (absent or empty; written all at once). ``dev_fraction`` of the training
    queries become the dev split when there is no ``dev`` source."""
    if "train" not in splits:
        raise DataError("no training split to convert")
    if not 0.0 <= dev_fraction < 1.0:
        raise DataError(f"--dev-fraction must be in [0, 1), got {dev_fraction}")
    if dev_fraction and "dev" in splits:
        raise DataError(f"{splits['dev'].name} is a dev split already: drop --dev-fraction")
    names = names or ColumnNames()
    report = Report()
    builder = _Builder(report)
    with staged_directory(target) as staging:
        # test first: a query also in train is kept in test only (never trained on)
        for split in ("test", "dev", "train"):
            if split not in splits:
                continue
            source = splits[split]
            columns = resolve_columns(source.columns, source.name, names.query,
                                      names.positive, names.negative)
            report.columns[split] = columns.describe()
            held_out = {q: s for s in ("test", "dev") if s != split for q in builder.qrels[s]}
            builder.add(split, source, columns, held_out)
        if dev_fraction:
            builder.hold_out_dev(dev_fraction, seed)
        builder.write(staging)
    return report


def convert_pairs(train: Path, target: Path, test: Path | None = None,
                  names: ColumnNames | None = None, dev_fraction: float = 0.0,
                  seed: int = 42) -> Report:
    splits = {"train": read_pairs_file(train)}
    if test is not None:
        splits["test"] = read_pairs_file(test)
    return convert_splits(splits, target, names, dev_fraction, seed)


def convert_hf(directory: Path, target: Path, names: ColumnNames | None = None,
               dev_fraction: float = 0.0, seed: int = 42) -> Report:
    return convert_splits(read_hf_folder(directory), target, names, dev_fraction, seed)
