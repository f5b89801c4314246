"""The format of an embedding shard object: ``ids`` and ``vectors`` in one ``.npz``.

Corpus shards carry document indices (int64); query shards carry the query ids (strings),
so a reader maps vectors to queries by id, never by a positional convention.

``vectors`` are stored as ``inference.embedding_dtype`` (float16 by default: half the bytes
of float32 to store and move; docs/benchmarks/embedding-dtype.md measures that retrieval does
not change). The dtype is in the array's own ``.npy`` header, so a reader needs no setting:
:func:`unpack_embeddings` returns float32 whatever the shard holds (FAISS works in float32),
and float32 shards written before the setting existed read as they always did.
"""

from __future__ import annotations

import io
from typing import Literal

import numpy as np

EmbeddingDtype = Literal["float32", "float16"]
STORED_DTYPES: dict[str, np.dtype] = {"float32": np.dtype(np.float32),
                                      "float16": np.dtype(np.float16)}


def pack_embeddings(ids: np.ndarray, vectors: np.ndarray,
                    dtype: EmbeddingDtype = "float32") -> bytes:
    """One shard's bytes: ``vectors`` cast to ``dtype`` (round to nearest, numpy's cast)."""
    if dtype not in STORED_DTYPES:
        raise ValueError(f"embedding dtype {dtype!r}: expected one of {sorted(STORED_DTYPES)}")
    ids = np.asarray(ids)
    ids = ids.astype(np.str_) if ids.dtype.kind in "OUS" else ids.astype(np.int64)
    buffer = io.BytesIO()
    np.savez(buffer, ids=ids, vectors=np.asarray(vectors).astype(STORED_DTYPES[dtype]))
    return buffer.getvalue()


def unpack_embeddings(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """``ids`` and float32 ``vectors`` of a shard (float16 shards are upcast exactly)."""
    with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
        ids, vectors = arrays["ids"], arrays["vectors"]
    if vectors.dtype not in STORED_DTYPES.values():
        raise ValueError(f"embedding shard holds {vectors.dtype} vectors: expected one of "
                         f"{sorted(STORED_DTYPES)}")
    return ids, vectors.astype(np.float32, copy=False)


def stored_dtype(data: bytes) -> np.dtype:
    """The dtype a shard's ``vectors`` are stored in (for tests and diagnostics)."""
    with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
        return arrays["vectors"].dtype
