"""The format of an embedding shard object: ``ids`` and ``vectors`` in one ``.npz``.

Corpus shards carry document indices (int64); query shards carry the query ids (strings),
so a reader maps vectors to queries by id, never by a positional convention. With MaxP
(``data.passages.mode: max``) a corpus shard holds one row per passage: ``ids`` is each
passage's document (repeated) and ``passages`` its passage number within the document. The
index keys passage ``p`` of document ``d`` as ``d * max_passages + p`` (:func:`passage_keys`):
keys sort by document, then passage, so a shard's rows stay in corpus order, and
``key // max_passages`` is the document.

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
                    dtype: EmbeddingDtype = "float32",
                    passages: np.ndarray | None = None) -> bytes:
    """One shard's bytes: ``vectors`` cast to ``dtype`` (round to nearest, numpy's cast);
    ``passages``: each row's passage number (MaxP corpus shards)."""
    if dtype not in STORED_DTYPES:
        raise ValueError(f"embedding dtype {dtype!r}: expected one of {sorted(STORED_DTYPES)}")
    ids = np.asarray(ids)
    ids = ids.astype(np.str_) if ids.dtype.kind in "OUS" else ids.astype(np.int64)
    arrays = {"ids": ids, "vectors": np.asarray(vectors).astype(STORED_DTYPES[dtype])}
    if passages is not None:
        if len(passages) != len(ids):
            raise ValueError(f"{len(passages)} passage numbers for {len(ids)} rows")
        arrays["passages"] = np.asarray(passages, dtype=np.int16)
    buffer = io.BytesIO()
    # ignore: numpy's stub matches **arrays against savez's `allow_pickle: bool` too.
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    return buffer.getvalue()


def _read(data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A shard's ``ids``, float32 ``vectors`` and passage numbers (None without), read once."""
    with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
        ids, vectors = arrays["ids"], arrays["vectors"]
        passages = arrays["passages"].astype(np.int64) if "passages" in arrays.files else None
    if vectors.dtype not in STORED_DTYPES.values():
        raise ValueError(f"embedding shard holds {vectors.dtype} vectors: expected one of "
                         f"{sorted(STORED_DTYPES)}")
    return ids, vectors.astype(np.float32, copy=False), passages


def unpack_embeddings(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """``ids`` and float32 ``vectors`` of a shard (float16 shards are upcast exactly)."""
    ids, vectors, _ = _read(data)
    return ids, vectors


def unpack_passages(data: bytes) -> np.ndarray | None:
    """The passage number of each row of a MaxP corpus shard; None for any other shard."""
    return _read(data)[2]


def unpack_rows(data: bytes, max_passages: int | None) -> tuple[np.ndarray, np.ndarray]:
    """A corpus shard's row keys and float32 vectors: document indices, or with MaxP
    (``max_passages`` set) :func:`passage_keys`. A shard of the other kind is refused: the
    index of one checkpoint holds documents or passages, never both."""
    ids, vectors, passages = _read(data)  # one parse of the shard on the indexer's path
    if max_passages is None:
        if passages is not None:
            raise ValueError("a MaxP shard (with passage numbers) where documents are indexed "
                             "(data.passages.mode first)")
        return ids, vectors
    if passages is None:
        raise ValueError("a shard of whole documents where passages are indexed "
                         "(data.passages.mode max): it was encoded under another setting")
    return passage_keys(ids, passages, max_passages), vectors


def passage_keys(doc_ids: np.ndarray, passages: np.ndarray, max_passages: int) -> np.ndarray:
    """Row keys of passages ``passages`` of documents ``doc_ids`` (int64)."""
    passages = np.asarray(passages, dtype=np.int64)
    if len(passages) and (passages.min() < 0 or passages.max() >= max_passages):
        raise ValueError(f"passage numbers must lie in [0, {max_passages}): got "
                         f"{int(passages.min())}..{int(passages.max())}")
    return np.asarray(doc_ids, dtype=np.int64) * max_passages + passages


def documents_of(keys: np.ndarray, max_passages: int) -> np.ndarray:
    """The document of each row key (``-1`` stays ``-1``)."""
    keys = np.asarray(keys, dtype=np.int64)
    return np.where(keys >= 0, keys // max_passages, -1)



def stored_dtype(data: bytes) -> np.dtype:
    """The dtype a shard's ``vectors`` are stored in (for tests and diagnostics)."""
    with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
        return arrays["vectors"].dtype
