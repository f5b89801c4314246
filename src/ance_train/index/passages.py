"""MaxP over an index of passages: documents ranked by their best passage.

ANCE (arXiv:2007.00808, §5) scores a long document by the maximum of its passages' scores
("the max-pooling operation is natively supported by ANN"). :class:`PassageIndex` gives an
index of passage rows (row keys ``document * max_passages + passage``,
:func:`ance_train.protocol.embeddings.passage_keys`) the document-level interface the rest of
the indexer uses (``search``, ``scores``, ``best_vectors``), so mining, evaluation and the
Search service answer in documents without knowing about passages.

Search is exact with respect to the index underneath: a document has at most
``max_passages`` passages, so the top ``k × max_passages`` passages hold at least ``k``
distinct documents, and the documents in order of their first passage in that list are the
top ``k`` by maximum (:func:`collapse_to_documents`). Ties stay in the canonical order
(:func:`ance_train.index.merge.canonical_order`): keys of a lower document are lower, so
documents tied in score come lowest index first, as whole-document indexes rank them. A
document's passages are all in one corpus shard, hence in one index partition, so the
partitions' document lists merge exactly as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from ance_train.index.ann import blockwise_scores
from ance_train.index.merge import PAD
from ance_train.protocol.embeddings import documents_of


class PassageRows(Protocol):
    """An index of passage rows (:class:`~ance_train.index.ann.AnnIndex` or the partitions'
    :class:`~ance_train.indexer.partitions.MergedIndex`)."""

    dim: int

    def vectors(self, doc_ids: np.ndarray) -> np.ndarray: ...

    def present(self, keys: np.ndarray) -> np.ndarray: ...

    def search(self, queries: np.ndarray, k: int, batch_size: int = 1024,
               cancel: Callable[[], None] | None = None) -> tuple[np.ndarray, np.ndarray]: ...


def collapse_to_documents(keys: np.ndarray, scores: np.ndarray, k: int, max_passages: int
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ranked passage lists (``[Q, D]`` keys in canonical order, ``-1`` padding) to the top
    ``k`` documents of each row by their best passage: (documents, scores, best passage
    numbers), ``-1`` / 0 / 0 where a row has fewer documents."""
    documents = documents_of(keys, max_passages)
    rows = len(documents)
    first = np.zeros(documents.shape, dtype=bool)
    if documents.size:
        order = np.argsort(documents, axis=1, kind="stable")  # list order within a document
        ordered = np.take_along_axis(documents, order, axis=1)
        leads = np.ones(ordered.shape, dtype=bool)
        leads[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
        np.put_along_axis(first, order, leads, axis=1)
        first &= documents >= 0
    width = min(k, documents.shape[1])
    out_docs = np.full((rows, width), PAD, dtype=np.int64)
    out_scores = np.zeros((rows, width), dtype=np.float32)
    out_passages = np.zeros((rows, width), dtype=np.int64)
    target = np.cumsum(first, axis=1) - 1
    selected = first & (target < width)
    row_index = np.broadcast_to(np.arange(rows)[:, None], documents.shape)[selected]
    column = target[selected]
    out_docs[row_index, column] = documents[selected]
    out_scores[row_index, column] = scores[selected]
    out_passages[row_index, column] = (keys % max_passages)[selected]
    return out_docs, out_scores, out_passages


class PassageIndex:
    """Documents over an index of their passages (see the module docstring)."""

    def __init__(self, rows: PassageRows, max_passages: int, documents: int) -> None:
        self.rows = rows
        self.max_passages = max_passages
        self.documents = documents
        self.dim = rows.dim

    def __len__(self) -> int:
        return self.documents

    def search(self, queries: np.ndarray, k: int, batch_size: int = 1024,
               cancel: Callable[[], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` documents by their best passage, and that passage's score."""
        keys, scores = self.rows.search(queries, k * self.max_passages, batch_size, cancel)
        documents, best, _ = collapse_to_documents(keys, scores, k, self.max_passages)
        return documents, best

    def keys_of(self, doc_ids: np.ndarray) -> np.ndarray:
        """Row keys of every passage the index holds of ``doc_ids`` (a flat array)."""
        flat = np.asarray(doc_ids, dtype=np.int64).ravel()
        keys = (flat[:, None] * self.max_passages + np.arange(self.max_passages)).ravel()
        return keys[self.rows.present(keys)]

    def _passage_scores(self, queries: np.ndarray, doc_ids: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray]:
        """``[Q, K, M]`` scores of every passage slot of each row's documents (``-inf`` for a
        slot the document does not fill) and their row keys."""
        doc_ids = np.asarray(doc_ids, dtype=np.int64)
        rows, width = doc_ids.shape
        m = self.max_passages
        keys = doc_ids[:, :, None] * m + np.arange(m)
        present = self.rows.present(keys.ravel()).reshape(keys.shape)
        # An absent slot is scored with the document's first passage, then masked out.
        safe = np.where(present, keys, (doc_ids * m)[:, :, None])
        sims = blockwise_scores(self.rows.vectors, self.dim, queries,
                                safe.reshape(rows, width * m)).reshape(rows, width, m)
        return np.where(present, sims, -np.inf), safe

    def best_passages(self, queries: np.ndarray, doc_ids: np.ndarray) -> np.ndarray:
        """The passage number of each ``[Q, K]`` document that scores highest for its row's
        query (lowest number among ties; 0 for a ``-1`` document)."""
        doc_ids = np.asarray(doc_ids, dtype=np.int64)
        safe = np.where(doc_ids >= 0, doc_ids, 0)
        sims, _ = self._passage_scores(queries, safe)
        return np.where(doc_ids >= 0, np.argmax(sims, axis=2), 0)

    def scores(self, queries: np.ndarray, doc_ids: np.ndarray) -> np.ndarray:
        """MaxP score of each query row with the documents of its ``doc_ids`` row."""
        sims, _ = self._passage_scores(queries, doc_ids)
        return sims.max(axis=2).astype(np.float32)

    def best_vectors(self, queries: np.ndarray, doc_ids: np.ndarray) -> np.ndarray:
        """The vector of each query's document (``[Q]``) passage that scores highest for it:
        what the query is compared with (the positive's score, ANCE-Tele's lookahead)."""
        doc_ids = np.asarray(doc_ids, dtype=np.int64)
        passages = self.best_passages(queries, doc_ids[:, None])[:, 0]
        return self.rows.vectors(doc_ids * self.max_passages + passages)
