"""Cosine similarity is normalised once, in the model: the indexer's inner-product index over a
cosine BiEncoder's embeddings scores exactly as the former double normalisation (model, then
``AnnIndex(similarity="cosine")`` again) did."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertModel

from ance_train.config import IndexConfig, default_model_path
from ance_train.index.ann import AnnIndex
from ance_train.modeling.encoding import encode_texts, prepare_model
from ance_train.modeling.model import BiEncoder, load_tokenizer

WORDS = ["dense", "retrieval", "negatives", "index", "vitamin", "bone", "density", "brain",
         "matter", "tensor", "imaging", "training", "refresh", "checkpoint", "query",
         "document", "corpus", "cosine", "similarity", "embedding"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def _cosine_model(tokenizer, projection_dim: int | None = None) -> BiEncoder:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    return BiEncoder(BertModel(config), pooling="mean", projection_dim=projection_dim,
                     similarity="cosine").eval()


def _texts(count: int, seed: int) -> list[str]:
    """``count`` distinct random texts (no duplicate embeddings, so no tied scores)."""
    rng = np.random.default_rng(seed)
    texts: dict[str, None] = {}
    while len(texts) < count:
        texts[" ".join(rng.choice(WORDS, size=int(rng.integers(3, 12))))] = None
    return list(texts)


@pytest.fixture(scope="module")
def embedded(tokenizer) -> tuple[np.ndarray, np.ndarray]:
    model = _cosine_model(tokenizer)
    docs = encode_texts(model, tokenizer, _texts(300, 1), max_length=24)
    queries = encode_texts(model, tokenizer, _texts(40, 2), max_length=24)
    return docs, queries


def _index(kind: str, vectors: np.ndarray, similarity: str) -> AnnIndex:
    config = IndexConfig.model_validate({"type": kind, "device": "cpu"})
    index = AnnIndex(vectors.shape[1], config, similarity)
    ids = np.arange(1000, 1000 + len(vectors)) * 3  # document indices, not rows
    index.add(ids[:120], vectors[:120])
    index.add(ids[120:], vectors[120:])
    index.finalize()
    return index


def test_the_model_returns_unit_vectors(embedded) -> None:
    docs, queries = embedded
    assert docs.dtype == np.float32
    assert np.allclose(np.linalg.norm(docs, axis=1), 1.0, atol=1e-6)
    assert np.allclose(np.linalg.norm(queries, axis=1), 1.0, atol=1e-6)


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_scores_are_unchanged_without_the_index_normalising_again(embedded, kind) -> None:
    docs, queries = embedded
    once_ids, once_scores = _index(kind, docs, "dot").search(queries, 50)
    twice_ids, twice_scores = _index(kind, docs, "cosine").search(queries, 50)
    assert np.allclose(once_scores, twice_scores, atol=1e-6)
    assert np.array_equal(once_ids, twice_ids)
    # The stored vectors (read back for exact candidate scores) are the same too.
    some = _index(kind, docs, "dot").search(queries[:3], 5)[0]
    assert np.allclose(_index(kind, docs, "dot").vectors(some),
                       _index(kind, docs, "cosine").vectors(some), atol=1e-6)


def test_exact_scores_equal_cosines(embedded) -> None:
    docs, queries = embedded
    index = _index("flat", docs, "dot")
    ids, scores = index.search(queries, 10)
    rows = ids // 3 - 1000
    cosines = np.einsum("qd,qkd->qk", queries.astype(np.float64), docs[rows].astype(np.float64))
    assert np.allclose(scores, cosines, atol=1e-5)
    assert np.allclose(index.scores(queries, ids), scores, atol=1e-5)


def test_a_bf16_model_returns_float32_unit_vectors(tokenizer) -> None:
    model = prepare_model(_cosine_model(tokenizer, projection_dim=16), "bf16", "cpu")
    enc = tokenizer(_texts(8, 3), padding=True, return_tensors="pt")
    with torch.inference_mode():
        out = model(enc["input_ids"], enc["attention_mask"])
    assert out.dtype == torch.float32
    assert torch.allclose(out.norm(dim=-1), torch.ones(8), atol=1e-6)
