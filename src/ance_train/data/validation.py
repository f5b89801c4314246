"""Dataset validation: every file is read once, line by line, before any training work starts
(a local file, or an object of an ``s3://`` dataset streamed in one GET: ``data/source.py``).

Every problem found is collected (each naming the file and its 1-based line number) and one
:class:`DataError` lists them. On success two files are written, atomically, to a cache
directory: ``doc_offsets.npy`` (the byte offset of each document line; a document's index is
its position in the file) and ``dataset.json`` (the :class:`~ance_train.data.dataset.DatasetIndex`).
"""

from __future__ import annotations

import functools
import logging
import random
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from ance_train.config import (
    MIN_DEV_QUERIES,
    SMALL_TRAIN_LEARNING_RATE,
    SMALL_TRAIN_QUERIES,
    DataConfig,
    TrainingConfig,
)
from ance_train.data.dataset import DatasetIndex, Qrels, is_positive
from ance_train.data.formats import (
    DatasetFiles,
    LineError,
    decode_line,
    is_blank,
    numbered_lines,
    parse_doc,
    parse_int,
    parse_query,
    text_kind,
)
from ance_train.data.problems import Problems, display_path, quote
from ance_train.data.source import DataFile, open_binary
from ance_train.infra.atomic import atomic_write
from ance_train.protocol.keys import DATASET_INDEX_FILE, DOC_OFFSETS_FILE

_Parsed = TypeVar("_Parsed")

logger = logging.getLogger(__name__)

MAX_NAMED_IDS = 10
"""How many ids a warning names before "…and N more"."""


def _name_ids(ids: Sequence[str]) -> str:
    named = ", ".join(quote(i) for i in ids[:MAX_NAMED_IDS])
    if len(ids) > MAX_NAMED_IDS:
        named += f", …and {len(ids) - MAX_NAMED_IDS} more"
    return named


def _parsed_lines(path: DataFile, parse: Callable[[bytes], _Parsed], name: str,
                  problems: Problems) -> Iterator[tuple[int, int, _Parsed]]:
    """(1-based line number, byte offset, ``parse(line)``) of each non-blank line of ``path``;
    a line that ``parse`` rejects is recorded in ``problems`` and skipped."""
    with open_binary(path) as handle:
        for line_no, offset, raw in numbered_lines(handle):
            if is_blank(raw):
                continue
            try:
                parsed = parse(raw)
            except LineError as error:
                problems.at(name, line_no, str(error))
                continue
            yield line_no, offset, parsed


@dataclass
class _CorpusScan:
    doc_index: dict[str, int]
    offsets: array
    empty_ids: list[str]


def _scan_corpus(path: DataFile, kind: str, name: str, problems: Problems) -> _CorpusScan:
    doc_index: dict[str, int] = {}
    first_line = array("q")  # line number of each document, for duplicate messages
    offsets = array("q")
    empty_ids: list[str] = []
    parse = functools.partial(parse_doc, kind=kind)
    for line_no, offset, (doc_id, title, text) in _parsed_lines(path, parse, name, problems):
        seen = doc_index.get(doc_id)
        if seen is not None:
            problems.at(
                name,
                line_no,
                f"duplicate document id {quote(doc_id)} (first seen on line "
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
    path: DataFile, kind: str, name: str, problems: Problems
) -> tuple[dict[str, str], list[str]]:
    queries: dict[str, str] = {}
    first_line: dict[str, int] = {}
    empty_ids: list[str] = []
    parse = functools.partial(parse_query, kind=kind)
    for line_no, _, (qid, text) in _parsed_lines(path, parse, name, problems):
        if qid in first_line:
            problems.at(
                name,
                line_no,
                f"duplicate query id {quote(qid)} (first seen on line {first_line[qid]})",
            )
            continue
        first_line[qid] = line_no
        queries[qid] = text
        if not text.strip():
            empty_ids.append(qid)
    return queries, empty_ids


def _scan_qrels(
    path: DataFile,
    name: str,
    doc_index: dict[str, int],
    queries: dict[str, str],
    problems: Problems,
    warnings: list[str],
    query_lines: dict[str, int] | None = None,
) -> Qrels:
    """Positive qrels of one file, keyed by document index, in order of first appearance;
    ``query_lines`` (if given) receives the first line of each query."""
    qrels: Qrels = {}
    first_line: dict[tuple[str, int], tuple[int, int]] = {}
    columns = 0  # 3 (BEIR: query-id, corpus-id, score) or 4 (TREC: qid, 0, pid, rel)
    duplicates = 0
    first = True
    with open_binary(path) as handle:
        for line_no, _, raw in numbered_lines(handle):
            if is_blank(raw):
                continue
            is_first, first = first, False
            try:
                line = decode_line(raw)
            except LineError as error:
                problems.at(name, line_no, str(error))
                continue
            parts = [p.strip() for p in line.split("\t")] if "\t" in line else line.split()
            if not columns and len(parts) in (3, 4):
                columns = len(parts)
            if is_first and len(parts) == columns and parse_int(parts[-1]) is None:
                continue  # header line
            if len(parts) != columns:
                expected = (
                    str(columns) if columns else "3 (qid, docid, rel) or 4 (qid, 0, docid, rel)"
                )
                problems.at(name, line_no, f"expected {expected} columns, found {len(parts)}")
                continue
            qid, did, score = parts[0], parts[-2], parts[-1]
            rel = parse_int(score)
            if rel is None:
                problems.at(name, line_no, f"relevance must be an integer, found {quote(score)}")
                continue
            bad = False
            if qid not in queries:
                problems.at(name, line_no, f"unknown query id {quote(qid)}")
                bad = True
            index = doc_index.get(did)
            if index is None:
                problems.at(name, line_no, f"unknown document id {quote(did)}")
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
                        f"query {quote(qid)} document {quote(did)} has relevance {rel} but "
                        f"{seen_rel} on line {seen_line}",
                    )
                else:
                    duplicates += 1
                continue
            first_line[(qid, index)] = (line_no, rel)
            if query_lines is not None:
                query_lines.setdefault(qid, line_no)
            if is_positive(rel):
                qrels.setdefault(qid, {})[index] = rel
    if duplicates:
        noun = "judgement" if duplicates == 1 else "judgements"
        warnings.append(f"{name}: {duplicates} repeated {noun} ignored")
    return qrels


def _split_train(train: Qrels, cfg: DataConfig, seed: int,
                 cut_dev: bool = True) -> tuple[Qrels, Qrels]:
    """Hold out the dev queries (unless the dev split has a file of its own: ``cut_dev``
    False) and cap the train queries, deterministically."""
    order = sorted(train)
    random.Random(seed).shuffle(order)
    n_dev = min(round(cfg.dev_fraction * len(order)), cfg.dev_max_queries, len(order) - 1)
    n_dev = max(n_dev, 0) if cut_dev else 0
    dev_ids = set(order[:n_dev])
    train_ids = order[n_dev:]
    if cfg.max_train_queries is not None:
        train_ids = train_ids[: cfg.max_train_queries]
    keep = set(train_ids)
    return (
        {q: docs for q, docs in train.items() if q in keep},
        {q: docs for q, docs in train.items() if q in dev_ids},
    )


def dev_size_warning(index: DatasetIndex) -> str | None:
    """A warning when the dev split is too small for checkpoint selection to mean much
    (fewer than :data:`~ance_train.config.MIN_DEV_QUERIES` queries; the reasoning is there);
    ``validate`` and ``run`` print it. Not one of the index's own warnings: the dataset is
    valid, only the selection made on it is weak."""
    n = len(index.dev)
    if n >= MIN_DEV_QUERIES:
        return None
    return (f"the dev split has {n} quer{'y' if n == 1 else 'ies'}, below {MIN_DEV_QUERIES}: "
            "the best checkpoint on dev nDCG@10 (export --checkpoint best, early stopping, "
            "bench/quality.py) is chosen within noise of about ±0.3/sqrt(n) "
            f"(±{0.3 / max(n, 1) ** 0.5:.2f}); raise data.dev_fraction / data.dev_max_queries "
            "or give a dev qrels file, and read each eval report's dev_ci95")


def small_training_set_advice(index: DatasetIndex, learning_rate: float) -> str | None:
    """Advice when the training set is small (fewer than
    :data:`~ance_train.config.SMALL_TRAIN_QUERIES` queries with a positive) and the learning
    rate above the one that held dev there (the evidence is beside the constants); ``validate``
    and ``run`` print it. None otherwise."""
    n = index.trainable_queries
    if n >= SMALL_TRAIN_QUERIES or learning_rate <= SMALL_TRAIN_LEARNING_RATE:
        return None
    return (f"{n} training queries, below {SMALL_TRAIN_QUERIES}: at training.learning_rate "
            f"{learning_rate:g} a small training set can pull the model below where it "
            f"started; on 150-query proxies {SMALL_TRAIN_LEARNING_RATE:g} held dev where 5e-05 "
            f"lost (docs/benchmarks/quality-small.md): consider --set "
            f"training.learning_rate={SMALL_TRAIN_LEARNING_RATE:g}")


def small_training_set_blend(index: DatasetIndex, training: TrainingConfig) -> str | None:
    """What ``training.wise_ft_alpha: auto`` chose, when it chose a blend (a small training
    set); ``validate`` and ``run`` print it. None otherwise."""
    alpha = training.wise_ft_alpha_for(index.trainable_queries)
    if training.wise_ft_alpha != "auto" or alpha >= 1.0:
        return None
    return (f"{index.trainable_queries} training queries, below {SMALL_TRAIN_QUERIES}: "
            f"training.wise_ft_alpha auto publishes every checkpoint as θ0 + {alpha:g} (θ − θ0), "
            "the pretrained weights moved halfway to the trained ones (WiSE-FT; "
            "docs/benchmarks/small-heldout.md); set it to 1 for the trained weights")


def selection_notices(index: DatasetIndex, training: TrainingConfig) -> list[tuple[str, str]]:
    """What ``validate`` and ``run`` print about a small dataset before any work: (``warning``
    or ``note``, text) for :func:`dev_size_warning`, :func:`small_training_set_advice` and
    :func:`small_training_set_blend`."""
    notices = [("warning", dev_size_warning(index)),
               ("note", small_training_set_advice(index, training.learning_rate)),
               ("note", small_training_set_blend(index, training))]
    return [(level, text) for level, text in notices if text is not None]


def validate_dataset(cfg: DataConfig, cache_dir: str | Path, seed: int = 42) -> DatasetIndex:
    """Validate the dataset of ``cfg``, write ``doc_offsets.npy`` and ``dataset.json`` to
    ``cache_dir`` (atomically, only on success) and return the index.

    Raises :class:`DataError` listing up to :data:`MAX_ERRORS` problems, each naming the file
    and line. Empty documents and queries are legal and reported as warnings.
    """
    files = DatasetFiles.resolve(cfg)
    root = files.root
    problems = Problems(root)
    warnings: list[str] = []

    corpus_name = display_path(files.corpus, root)
    scan = _scan_corpus(files.corpus, text_kind(files.corpus, cfg.format), corpus_name, problems)
    queries_name = display_path(files.queries, root)
    queries, empty_queries = _scan_queries(
        files.queries, text_kind(files.queries, cfg.format), queries_name, problems
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

    train_name = display_path(files.train_qrels, root)
    train_all = _scan_qrels(
        files.train_qrels, train_name, scan.doc_index, queries, problems, warnings
    )
    test: Qrels = {}
    if files.test_qrels is not None:
        test = _scan_qrels(
            files.test_qrels,
            display_path(files.test_qrels, root),
            scan.doc_index,
            queries,
            problems,
            warnings,
        )
    dev_file: Qrels | None = None
    if files.dev_qrels is not None:
        dev_name = display_path(files.dev_qrels, root)
        dev_lines: dict[str, int] = {}
        dev_file = _scan_qrels(files.dev_qrels, dev_name, scan.doc_index, queries, problems,
                               warnings, dev_lines)
        # Selecting checkpoints on queries the model trained on (or is tested on) would
        # select nothing: an official dev split must be disjoint from both.
        for other, split in (("train", train_all), ("test", test)):
            for qid in sorted(set(dev_file) & set(split), key=dev_lines.__getitem__):
                problems.at(dev_name, dev_lines[qid],
                            f"query {quote(qid)} is also in the {other} qrels")
        if not dev_file and not problems.count:
            problems.add(f"{dev_name}: no dev judgements with relevance > 0")
    if not train_all and not problems.count:
        problems.add(f"{train_name}: no training judgements with relevance > 0")
    problems.raise_if_any()
    scan.doc_index = {}  # the only per-document structure; not needed any more

    overlap = sorted(set(train_all) & set(test))
    if overlap:
        warnings.append(
            f"{len(overlap)} queries are in both the train and test qrels: {_name_ids(overlap)}"
        )
    train, dev = _split_train(train_all, cfg, seed, cut_dev=dev_file is None)
    if dev_file is not None:
        dev = dev_file
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
