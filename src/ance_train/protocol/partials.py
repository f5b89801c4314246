"""The format of an index partition's partial results: its local top-K lists, per query group.

One ``.npz`` per partition and checkpoint (:func:`ance_train.protocol.keys.partial_results`).
A *group* is a set of queries searched together at one depth: ``train`` (the training
queries, for mining and the diagnostics) and one per evaluated split (``dev``, ``test``).
Each group holds the query ids (so no reader relies on an order), the global document
indices (``-1`` where the partition has fewer than K documents) and their float32 scores.
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


def pack_partials(groups: dict[str, TopK]) -> bytes:
    arrays: dict[str, np.ndarray] = {}
    for name, group in groups.items():
        if "." in name:
            raise ValueError(f"group name {name!r} contains a dot")
        arrays[f"{name}.query_ids"] = np.asarray(group.query_ids).astype(np.str_)
        arrays[f"{name}.ids"] = group.ids.astype(np.int64)
        arrays[f"{name}.scores"] = group.scores.astype(np.float32)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def unpack_partials(data: bytes) -> dict[str, TopK]:
    with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
        names = sorted({key.rsplit(".", 1)[0] for key in arrays.files})
        return {name: TopK(arrays[f"{name}.query_ids"], arrays[f"{name}.ids"],
                           arrays[f"{name}.scores"]) for name in names}
