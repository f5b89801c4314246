"""The validated part of a dataset every service fetches: :class:`DatasetIndex` (the queries
used and the train / dev / test qrels keyed by document index) and the one definition of a
positive."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ance_train.data.problems import DataError
from ance_train.protocol.keys import DATASET_INDEX_FILE

INDEX_VERSION = 1

Qrels = dict[str, dict[int, int]]
"""Query id → {document index: graded relevance > 0}."""

SPLITS = ("train", "dev", "test")


def is_positive(relevance: int) -> bool:
    """Whether a judgement makes the document a positive of its query: relevance > 0 (graded
    qrels judge non-relevant documents with 0). The one definition of a positive."""
    return relevance > 0


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

    @property
    def trainable_queries(self) -> int:
        """Training queries with a positive: what one epoch passes over (the trainer's
        ``BatchBuilder`` cycles through exactly these; ``config.resolve_budget``)."""
        return sum(1 for qid in self.train if self.positives(qid))

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
