"""The format of an index partition's partial results: its local top-K lists, per query group.

One ``.npz`` per partition and checkpoint (:func:`ance_train.protocol.keys.partial_results`).
A *group* is a set of queries searched together at one depth: ``train`` (the training
queries, for mining and the diagnostics) and one per evaluated split (``dev``, ``test``).
Each group holds the query ids (so no reader relies on an order), the global document
indices (``-1`` where the partition has fewer than K documents) and their float32 scores.
Beside the groups, the vectors the partition's index holds for the training positives it
owns (``doc_ids``, ``doc_vectors``): what the mining asks of the index besides the lists
(the anchor positive of every query, DANCE's positive documents), so partition 0 need not
read the corpus shards back for them.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TopK:
    """Ranked lists of a group of queries: row i belongs to ``query_ids[i]``."""

    query_ids: np.ndarray  # [Q] str
    ids: np.ndarray        # [Q, K] int64 document indices, -1 = none
    scores: np.ndarray     # [Q, K] float32

    def __post_init__(self) -> None:
        if self.ids.shape != self.scores.shape or self.ids.ndim != 2 or (
                len(self.ids) != len(self.query_ids)):
            raise ValueError(f"top-K lists of shapes ids {self.ids.shape}, scores "
                             f"{self.scores.shape}, {len(self.query_ids)} query ids")


@dataclass(frozen=True)
class Partials:
    """A partition's lists per group and the stored vectors of some of its documents."""

    groups: dict[str, TopK]
    doc_ids: np.ndarray      # [N] int64 document indices
    doc_vectors: np.ndarray  # [N, dim] float32


VECTORS = "_vectors"  # the npz prefix of ``doc_ids`` / ``doc_vectors`` (not a group name)


def pack_partials(groups: dict[str, TopK], doc_ids: np.ndarray | None = None,
                  doc_vectors: np.ndarray | None = None) -> bytes:
    arrays: dict[str, np.ndarray] = {
        f"{VECTORS}.ids": np.asarray([] if doc_ids is None else doc_ids, dtype=np.int64),
        f"{VECTORS}.vectors": (np.zeros((0, 0), np.float32) if doc_vectors is None
                               else np.asarray(doc_vectors, dtype=np.float32))}
    for name, group in groups.items():
        if "." in name or name == VECTORS:
            raise ValueError(f"group name {name!r} is reserved or contains a dot")
        arrays[f"{name}.query_ids"] = np.asarray(group.query_ids).astype(np.str_)
        arrays[f"{name}.ids"] = group.ids.astype(np.int64)
        arrays[f"{name}.scores"] = group.scores.astype(np.float32)
    buffer = io.BytesIO()
    # ignore: numpy's stub matches **arrays against savez's `allow_pickle: bool` too.
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    return buffer.getvalue()


def unpack_partials(data: bytes) -> Partials:
    with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
        names = sorted({key.rsplit(".", 1)[0] for key in arrays.files} - {VECTORS})
        groups = {name: TopK(arrays[f"{name}.query_ids"], arrays[f"{name}.ids"],
                             arrays[f"{name}.scores"]) for name in names}
        return Partials(groups, arrays[f"{VECTORS}.ids"], arrays[f"{VECTORS}.vectors"])
