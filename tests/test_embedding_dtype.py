"""``inference.embedding_dtype``: what a shard stores and what readers get back
(protocol/embeddings.py), and that the inferencer's uploader writes the configured dtype."""

from __future__ import annotations

import io

import numpy as np
import pytest
from pydantic import ValidationError

from ance_train.config import InferenceConfig
from ance_train.protocol.embeddings import pack_embeddings, stored_dtype, unpack_embeddings


def _vectors(rows: int = 50, dim: int = 64) -> np.ndarray:
    v = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_float16_shards_halve_the_vectors_and_read_back_as_float32() -> None:
    ids, vectors = np.arange(50), _vectors()
    half = pack_embeddings(ids, vectors, "float16")
    full = pack_embeddings(ids, vectors, "float32")
    assert stored_dtype(half) == np.float16 and stored_dtype(full) == np.float32
    assert len(half) < 0.55 * len(full)
    read_ids, read = unpack_embeddings(half)
    assert read.dtype == np.float32 and read_ids.tolist() == ids.tolist()
    # Exactly numpy's round-to-nearest cast, upcast exactly: what the benchmark measures.
    assert np.array_equal(read, vectors.astype(np.float16).astype(np.float32))
    assert 0 < np.abs(read - vectors).max() < 1e-3
    assert np.array_equal(unpack_embeddings(full)[1], vectors)


def test_a_float32_shard_written_before_the_setting_still_reads() -> None:
    vectors = _vectors(3)
    buffer = io.BytesIO()
    np.savez(buffer, ids=np.array(["q1", "q2", "q3"]), vectors=vectors)  # the old writer
    ids, read = unpack_embeddings(buffer.getvalue())
    assert ids.tolist() == ["q1", "q2", "q3"] and np.array_equal(read, vectors)


def test_other_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        pack_embeddings(np.arange(2), _vectors(2), "bfloat16")  # type: ignore[arg-type]
    buffer = io.BytesIO()
    np.savez(buffer, ids=np.arange(2), vectors=_vectors(2).astype(np.float64))
    with pytest.raises(ValueError, match="float64"):
        unpack_embeddings(buffer.getvalue())
    with pytest.raises(ValidationError, match="embedding_dtype"):
        InferenceConfig(embedding_dtype="int8")


def test_float16_is_the_default() -> None:
    assert InferenceConfig().embedding_dtype == "float16"
