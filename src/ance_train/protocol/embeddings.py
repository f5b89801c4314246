"""The format of an embedding shard object: ``ids`` and float32 ``vectors`` in one ``.npz``.

Corpus shards carry document indices (int64); query shards carry the query ids (strings),
so a reader maps vectors to queries by id, never by a positional convention.
"""

from __future__ import annotations

import io

import numpy as np


def pack_embeddings(ids: np.ndarray, vectors: np.ndarray) -> bytes:
    ids = np.asarray(ids)
    ids = ids.astype(np.str_) if ids.dtype.kind in "OUS" else ids.astype(np.int64)
    buffer = io.BytesIO()
    np.savez(buffer, ids=ids, vectors=vectors.astype(np.float32))
    return buffer.getvalue()


def unpack_embeddings(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
        return arrays["ids"], arrays["vectors"]
