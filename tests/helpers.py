"""Shared test fixtures: a tiny random BERT and a small, consistent SciFact subset."""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from support.synthetic import make_tiny_bert  # noqa: F401 - re-exported

REPO = Path(__file__).resolve().parents[1]
SCIFACT = Path(os.environ.get("ANCE_SCIFACT_DIR", REPO.parent / "shared" / "data" / "scifact"))


def scifact_dir() -> Path:
    """The SciFact copy the tests use; a missing copy is an error, never a silent skip."""
    if not (SCIFACT / "corpus.jsonl").is_file():
        raise FileNotFoundError(
            f"SciFact not found at {SCIFACT}: the tests need ../shared/data/scifact "
            "(or ANCE_SCIFACT_DIR)"
        )
    return SCIFACT


def make_scifact_subset(directory: Path, max_docs: int = 300, max_queries: int = 120) -> Path:
    """First ``max_docs`` SciFact documents plus every query whose positives all lie among them.

    Keeps the qrels consistent with the smaller corpus, so validation passes honestly.
    """
    source = scifact_dir()
    directory.mkdir(parents=True, exist_ok=True)
    doc_ids: set[str] = set()
    with open(source / "corpus.jsonl") as src, open(directory / "corpus.jsonl", "w") as dst:
        for line, _ in zip(src, range(max_docs), strict=False):
            doc_ids.add(json.loads(line)["_id"])
            dst.write(line)
    (directory / "qrels").mkdir(exist_ok=True)
    kept_queries: set[str] = set()
    for split in ("train", "test"):
        rows = (source / "qrels" / f"{split}.tsv").read_text().splitlines()
        by_query: dict[str, list[str]] = {}
        for row in rows[1:]:
            qid = row.split("\t")[0]
            by_query.setdefault(qid, []).append(row)
        lines = [rows[0]]
        taken = 0
        for qid, qrows in by_query.items():
            if taken >= max_queries:
                break
            if all(r.split("\t")[1] in doc_ids for r in qrows):
                lines += qrows
                kept_queries.add(qid)
                taken += 1
        (directory / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    with open(source / "queries.jsonl") as src, open(directory / "queries.jsonl", "w") as dst:
        for line in src:
            if json.loads(line)["_id"] in kept_queries:
                dst.write(line)
    return directory


def write_config(path: Path, **sections: dict) -> Path:
    path.write_text(yaml.safe_dump(sections, sort_keys=False))
    return path
