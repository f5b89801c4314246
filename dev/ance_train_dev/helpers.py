"""Shared test fixtures: a tiny random BERT and a small, consistent SciFact subset."""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from ance_train_dev.synthetic import make_tiny_bert  # noqa: F401 - re-exported

REPO = Path(__file__).resolve().parents[2]
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


EXPORT_TEXTS = ["what causes a fever?", "Vitamin D deficiency is linked to bone loss.",
                "dense retrieval with hard negatives"]


def assert_export_loads_like(out: Path, checkpoint_dir: Path, model_config) -> None:
    """The exported ``out`` loads with sentence-transformers and transformers.AutoModel, and
    both give the embeddings of the run's own BiEncoder of ``checkpoint_dir`` (within 1e-5)."""
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    from ance_train.modeling.model import BiEncoder, load_tokenizer

    own = BiEncoder.from_pretrained(checkpoint_dir, model_config).eval()
    tokens = load_tokenizer(checkpoint_dir)(EXPORT_TEXTS, padding=True, truncation=True,
                                            max_length=512, return_tensors="pt")
    with torch.no_grad():
        expected = own(tokens["input_ids"], tokens["attention_mask"]).float().numpy()
    exported = SentenceTransformer(str(out), device="cpu").encode(EXPORT_TEXTS,
                                                                  convert_to_numpy=True)
    np.testing.assert_allclose(exported, expected, atol=1e-5)
    encoder = AutoModel.from_pretrained(str(out)).eval()
    hf_tokens = AutoTokenizer.from_pretrained(str(out))(EXPORT_TEXTS, padding=True,
                                                        return_tensors="pt")
    with torch.no_grad():
        hidden = encoder(**hf_tokens).last_hidden_state
    mask = hf_tokens["attention_mask"].unsqueeze(-1).float()
    pooled = ((hidden * mask).sum(1) / mask.sum(1)).numpy()
    if own.pooling == "cls":
        pooled = hidden[:, 0].numpy()
    if own.similarity == "cosine":
        pooled = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
    np.testing.assert_allclose(pooled, expected, atol=1e-5)


def model_card_metadata(out: Path) -> dict:
    """The YAML metadata block of ``out/README.md``."""
    text = (out / "README.md").read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def card_metrics(metadata: dict) -> dict[str, dict[str, float]]:
    """model-index results as {split: {metric type: value}}."""
    return {r["dataset"]["split"]: {m["type"]: m["value"] for m in r["metrics"]}
            for r in metadata["model-index"][0]["results"]}
