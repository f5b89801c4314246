"""Merging top-K lists of index partitions into the global top-K (and the one tie rule).

Each partition searches its own part of the corpus; the global top-K of a query is the best
K of the union of the partitions' lists (the pattern of distributed-faiss and of Tevatron's
sharded search, which merge per-shard results by score). A flat (exact) partition returns
the exact top-K of its part, so the merge is exactly what one flat index over the whole
corpus gives, provided ties are broken alike: every ranked list here is in
:func:`canonical_order` (score descending, then document index ascending, ``-1`` padding
last). FAISS keeps the lowest rows among tied scores at the cut-off, and both one index and
every partition add documents in ascending order, so the same documents survive the cut.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PAD = -1
MERGE_ROWS = 4096  # queries merged at once: memory is rows × (sum of list widths)


def canonical_order(ids: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row sorted by score descending, ties by document index ascending, padding
    (``ids < 0``) last; a row already in that order is unchanged."""
    if ids.size == 0:
        return ids, scores
    pad = ids < 0
    order = np.lexsort((np.where(pad, np.iinfo(np.int64).max, ids),
                        -np.where(pad, 0.0, scores.astype(np.float64)), pad), axis=1)
    return np.take_along_axis(ids, order, axis=1), np.take_along_axis(scores, order, axis=1)


def merge_topk(lists: Sequence[tuple[np.ndarray, np.ndarray]], k: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """The global top-``k`` of the same queries' lists from several partitions (each
    ``(ids [Q, K_p], scores [Q, K_p])``, ``-1`` where a partition has fewer documents).

    The result is ``min(k, ΣK_p)`` wide, in :func:`canonical_order`; where fewer than that
    many documents exist in all, the row ends with ``-1`` (score 0), as ``AnnIndex.search``
    pads.
    """
    if not lists:
        raise ValueError("no partial lists to merge")
    rows = {len(ids) for ids, _ in lists}
    if len(rows) != 1:
        raise ValueError(f"partial lists of different query counts: {sorted(rows)}")
    (count,) = rows
    width = min(k, sum(ids.shape[1] for ids, _ in lists))
    out_ids = np.full((count, width), PAD, dtype=np.int64)
    out_scores = np.zeros((count, width), dtype=np.float32)
    for start in range(0, count, MERGE_ROWS):
        stop = start + MERGE_ROWS
        ids = np.concatenate([i[start:stop] for i, _ in lists], axis=1).astype(np.int64)
        scores = np.concatenate([s[start:stop] for _, s in lists], axis=1).astype(np.float32)
        ids, scores = canonical_order(ids, scores)
        ids, scores = ids[:, :width], scores[:, :width]
        out_ids[start:stop] = ids
        out_scores[start:stop] = np.where(ids >= 0, scores, 0.0)
    return out_ids, out_scores
