"""The FAISS inner-product index over one checkpoint's corpus embeddings.

ANCE §5 uses ``IndexFlatIP``; it is exact, so the mined negatives are the true top-K of the
checkpoint. Searches run in batches of queries so no queries × corpus score matrix is ever
materialised beyond ``batch × corpus`` inside FAISS.
"""

from __future__ import annotations

import faiss
import numpy as np


class AnnIndex:
    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.index = faiss.IndexFlatIP(dim)
        self.doc_ids: list[np.ndarray] = []

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        if vectors.shape[1] != self.dim:
            raise ValueError(
                f"embedding dimension {vectors.shape[1]} != index dimension {self.dim}"
            )
        self.index.add(np.ascontiguousarray(vectors, dtype=np.float32))
        self.doc_ids.append(ids.astype(np.int64))

    def finalize(self) -> None:
        self._row_to_doc = np.concatenate(self.doc_ids) if self.doc_ids else np.zeros(0, np.int64)
        self._doc_to_row = {int(doc): row for row, doc in enumerate(self._row_to_doc)}

    def vectors(self, doc_ids: np.ndarray) -> np.ndarray:
        """The stored embeddings of ``doc_ids`` (document indices, not index rows)."""
        rows = np.array([self._doc_to_row[int(d)] for d in np.ravel(doc_ids)], dtype=np.int64)
        return self.index.reconstruct_batch(rows).reshape(*np.shape(doc_ids), self.dim)

    def __len__(self) -> int:
        return int(self.index.ntotal)

    def search(
        self, queries: np.ndarray, k: int, batch_size: int = 1024, should_stop=None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` document indices and scores per query (``-1`` where fewer exist)."""
        k = min(k, len(self))
        all_ids = np.full((len(queries), k), -1, dtype=np.int64)
        all_scores = np.zeros((len(queries), k), dtype=np.float32)
        for start in range(0, len(queries), batch_size):
            if should_stop is not None and should_stop():
                raise Superseded()
            chunk = np.ascontiguousarray(queries[start : start + batch_size], dtype=np.float32)
            scores, rows = self.index.search(chunk, k)
            ids = np.where(rows >= 0, self._row_to_doc[np.maximum(rows, 0)], -1)
            all_ids[start : start + len(chunk)] = ids
            all_scores[start : start + len(chunk)] = scores
        return all_ids, all_scores


class Superseded(Exception):
    """A newer checkpoint became complete while this one was being processed."""
