"""``ance-train export-negatives``: the negatives table of one refresh as a training set that
other trainers read.

- ``sentence-transformers``: triplets ``{"anchor", "positive", "negative"}``, one per mined
  negative of each training query, its positives taken in turn (a query with 2 positives and
  5 negatives gives 5 rows, positives 1, 2, 1, 2, 1), in the table's order (the rank under the
  checkpoint that mined it). ``--out`` ending in ``.jsonl``: JSON lines; otherwise a
  ``datasets`` folder (``save_to_disk``; needs the ``datasets`` extra).
- ``tevatron``: one JSON line per training query, ``{"query_id", "query",
  "positive_passages": [{"docid", "title", "text"}], "negative_passages": [...]}``.

Negatives are the table's candidates that the trainer can draw (not padding, a sampling
probability above 0), never a positive of the query (the indexer removed them already; a
table from elsewhere is checked again). Texts come from the run's corpus (``data.path``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ance_train.config import ConfigError, load_config
from ance_train.data.corpus import open_corpus
from ance_train.data.formats import doc_text
from ance_train.negatives.table import PAD, NegativesTable
from ance_train.protocol import keys
from ance_train.protocol.tables import TableId

FORMATS = ("sentence-transformers", "tevatron")
BATCH_QUERIES = 256  # queries whose documents are read from the corpus at once


class NegativesExportError(ValueError):
    """The run, table or output cannot be exported; the message says which."""


@dataclass
class ExportedNegatives:
    table: str
    out: Path
    rows: int
    queries: int
    negatives: int
    skipped_queries: int  # table rows whose query is not a training query with a positive
    positives_removed: int  # candidates that were positives of their query (not written)


def parse_table(checkpoint: str) -> TableId:
    if checkpoint == "bm25":
        return TableId.bm25()
    try:
        step = int(checkpoint)
    except ValueError:
        raise NegativesExportError(f"--checkpoint {checkpoint!r}: expected a step number or "
                                   "bm25") from None
    if step < 0:
        raise NegativesExportError(f"--checkpoint {step}: steps are >= 0")
    return TableId.ann(step)


def export_negatives(run_dir: Path, checkpoint: str, fmt: str, out: Path,
                     overwrite: bool = False, per_query: int | None = None,
                     store_dir: str | None = None) -> ExportedNegatives:
    """Write the negatives table ``checkpoint`` (a step, or ``bm25``) of the embedded run in
    ``run_dir`` to ``out`` in ``fmt`` (one of :data:`FORMATS`)."""
    from ance_train.infra.store import store_from_env
    from ance_train.runtime import fetch_dataset

    if fmt not in FORMATS:
        raise NegativesExportError(f"unknown format {fmt!r}: expected {', '.join(FORMATS)}")
    as_folder = fmt == "sentence-transformers" and out.suffix.lower() != ".jsonl"
    _check_out(out, overwrite)
    config_path = Path(run_dir) / "config.yaml"
    if not config_path.is_file():
        raise NegativesExportError(f"--run {run_dir}: no embedded run there ({config_path} "
                                   "is missing)")
    try:
        cfg = load_config(config_path)
    except ConfigError as error:
        raise NegativesExportError(f"{config_path}: {error}") from None
    table_id = parse_table(checkpoint)
    store = store_from_env(cfg.run_id, store_dir or str(Path(run_dir) / "store"))
    if not store.exists(table_id.key):
        tables = sorted(Path(k).stem for k in store.list(keys.NEGATIVES + "/")
                        if k.endswith(".npz") and not k.endswith("-dual.npz"))
        raise NegativesExportError(f"run {cfg.run_id} has no negatives table {table_id.key} "
                                   f"(stored: {', '.join(tables) or 'none'}; store.keep_"
                                   "refreshes may have removed older ones)")
    with tempfile.TemporaryDirectory(prefix="ance-negatives-") as scratch:
        work = Path(scratch)
        store.get_file(table_id.key, work / "table.npz")
        table = NegativesTable.open(work / "table.npz")
        if table.candidate_query_ids is not None:
            raise NegativesExportError(f"{table_id.key} holds negative queries (DANCE), not "
                                       "documents")
        dataset = fetch_dataset(store, work / "data")
        with open_corpus(cfg.data, work / "data") as corpus:
            result = ExportedNegatives(table_id.key, out, 0, 0, 0, 0, 0)
            records = _records(table, dataset, corpus, fmt, per_query, result)
            staged = out.parent / f".{out.name}.partial"
            _remove(staged)
            out.parent.mkdir(parents=True, exist_ok=True)
            try:
                jsonl = work / "rows.jsonl" if as_folder else staged
                with open(jsonl, "w", encoding="utf-8") as handle:
                    for record in records:
                        handle.write(json.dumps(record, ensure_ascii=False) + "\n")
                        result.rows += 1
                if as_folder:
                    _save_dataset(jsonl, staged, result.rows)
                _remove(out)
                os.replace(staged, out)
            except BaseException:
                _remove(staged)
                raise
    return result


def _records(table: NegativesTable, dataset: Any, corpus: Any, fmt: str,
             per_query: int | None, result: ExportedNegatives) -> Iterator[dict[str, Any]]:
    ids = np.asarray(table.query_ids).astype(str)
    for start in range(0, len(ids), BATCH_QUERIES):
        rows: list[tuple[str, list[int], list[int]]] = []
        for offset, query_id in enumerate(ids[start:start + BATCH_QUERIES].tolist()):
            row = start + offset
            if query_id not in dataset.train or query_id not in dataset.queries:
                result.skipped_queries += 1
                continue
            positives = dataset.positives(query_id, "train")
            drawable = ((table.candidates[row] != PAD) & (table.probabilities[row] > 0))
            negatives = []
            for doc in table.candidates[row][drawable].tolist():
                if doc in positives:
                    result.positives_removed += 1
                elif doc not in negatives:
                    negatives.append(doc)
            if per_query is not None:
                negatives = negatives[:per_query]
            if not negatives:
                result.skipped_queries += 1
                continue
            rows.append((query_id, positives, negatives))
        needed = sorted({d for _, pos, neg in rows for d in (*pos, *neg)})
        docs = dict(zip(needed, corpus.records(needed), strict=True))
        for query_id, positives, negatives in rows:
            result.queries += 1
            result.negatives += len(negatives)
            query = dataset.queries[query_id]
            if fmt == "tevatron":
                yield {"query_id": query_id, "query": query,
                       "positive_passages": [_passage(docs[d]) for d in positives],
                       "negative_passages": [_passage(docs[d]) for d in negatives]}
                continue
            for i, doc in enumerate(negatives):
                yield {"anchor": query, "positive": _text(docs[positives[i % len(positives)]]),
                       "negative": _text(docs[doc])}


def _passage(record: tuple[str, str, str]) -> dict[str, str]:
    doc_id, title, text = record
    return {"docid": doc_id, "title": title, "text": text}


def _text(record: tuple[str, str, str]) -> str:
    return doc_text(record[1], record[2])  # what the run encoded: "title text"


def _save_dataset(jsonl: Path, folder: Path, rows: int) -> None:
    try:
        import datasets
    except ImportError:
        raise NegativesExportError(
            "a sentence-transformers datasets folder needs the datasets package (pip install "
            "'ance-train[datasets]'); or give an --out ending in .jsonl") from None
    features = datasets.Features({name: datasets.Value("string")
                                  for name in ("anchor", "positive", "negative")})
    if rows:
        dataset = datasets.Dataset.from_json(str(jsonl), features=features,
                                             cache_dir=str(jsonl.parent / "hf-cache"))
    else:
        dataset = datasets.Dataset.from_dict({n: [] for n in features}, features=features)
    dataset.save_to_disk(str(folder))


def _check_out(out: Path, overwrite: bool) -> None:
    if ((out.is_dir() and any(out.iterdir())) or out.is_file()) and not overwrite:
        raise NegativesExportError(f"{out} exists: pass --overwrite to replace it")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
