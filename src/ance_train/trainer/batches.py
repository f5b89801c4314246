"""Training batches: queries, one positive each, hard negatives from the source in use, and
(DANCE) negative queries for each positive document."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ance_train.data.dataset import DatasetIndex
from ance_train.negatives.table import NegativesTable
from ance_train.trainer.negative_sources import NegativeSource


@dataclass
class TrainingBatch:
    query_ids: list[str]
    query_texts: list[str]
    doc_indices: list[int]          # columns: the B positives first, then hard negatives
    positive_column: torch.Tensor   # [B] column of each query's positive
    allowed: torch.Tensor           # [B, docs] which columns enter each query's softmax
    hard_negatives: int             # how many hard negatives the batch holds
    dual_query_texts: list[str]     # DANCE: negative queries of the positives (may be empty)
    dual_allowed: torch.Tensor | None  # [B, B + dual]: query i's positive query + its own ones
    # How many hard negatives / DANCE negative queries each query brought, in row order (their
    # columns follow the positives, resp. the B queries, query by query): what a data-parallel
    # rank needs to cut out its own slice of the global batch (trainer/distributed.py).
    negatives_per_query: list[int] = field(default_factory=list)
    dual_per_query: list[int] = field(default_factory=list)
    # MaxP: the passage of each column's document to train on (empty: the first of each).
    doc_passages: list[int] = field(default_factory=list)


class BatchBuilder:
    """Cycles through the training queries in shuffled epochs (seeded; resumable)."""

    def __init__(self, dataset: DatasetIndex, batch_size: int, negatives_per_query: int,
                 in_batch_negatives: bool, seed: int) -> None:
        self.positives = {qid: docs for qid in dataset.train
                          if (docs := dataset.positives(qid))}
        self.queries = dataset.queries
        self.order = sorted(self.positives)
        self.batch_size = min(batch_size, len(self.order))
        self.negatives_per_query = negatives_per_query
        self.in_batch = in_batch_negatives
        self.rng = np.random.default_rng(seed)
        self.epoch_order: list[str] = []
        self.cursor = 0

    def _next_queries(self) -> list[str]:
        """The next ``batch_size`` distinct queries; every query once per epoch.

        When a batch straddles two epochs and the new epoch's next query is already in the
        batch, it is swapped with a later one of the new epoch rather than dropped, so it
        keeps its turn.
        """
        picked: list[str] = []
        while len(picked) < self.batch_size:
            if self.cursor >= len(self.epoch_order):
                self.epoch_order = list(self.rng.permutation(self.order))
                self.cursor = 0
            order = self.epoch_order
            if order[self.cursor] in picked:
                later = next(k for k in range(self.cursor + 1, len(order))
                             if order[k] not in picked)
                order[self.cursor], order[later] = order[later], order[self.cursor]
            picked.append(order[self.cursor])
            self.cursor += 1
        return picked

    def build(self, source: NegativeSource | None, dual: NegativesTable | None = None,
              dual_per_positive: int = 1, passages: NegativesTable | None = None
              ) -> TrainingBatch:
        """The next batch; ``passages``: MaxP, the ANN table naming the passage of each
        positive and negative to train on (:meth:`NegativesTable.passage_of`: the one that
        scored highest for the query when the table was mined; the first passage of a
        document the table does not name, e.g. a BM25 warm-up negative)."""
        qids = self._next_queries()
        choices = [self.positives[q] for q in qids]
        drawn = self.rng.integers(0, [len(docs) for docs in choices])  # one draw per query
        positives = [docs[k] for docs, k in zip(choices, drawn.tolist(), strict=True)]
        negatives = (source.sample_many(qids, self.negatives_per_query, self.rng) if source
                     else [[] for _ in qids])
        columns = positives + [doc for row in negatives for doc in row]
        allowed = self._allowed(choices, columns, [len(row) for row in negatives])
        dual_texts, dual_allowed, dual_counts = self._dual(qids, positives, dual,
                                                           dual_per_positive)
        owners = qids + [q for q, row in zip(qids, negatives, strict=True) for _ in row]
        doc_passages = ([] if passages is None or passages.passages is None else
                        [passages.passage_of(q, d) for q, d in zip(owners, columns, strict=True)])
        return TrainingBatch(
            query_ids=qids, query_texts=[self.queries[q] for q in qids], doc_indices=columns,
            positive_column=torch.arange(len(qids)), allowed=allowed,
            hard_negatives=len(columns) - len(qids),
            dual_query_texts=dual_texts, dual_allowed=dual_allowed,
            negatives_per_query=[len(row) for row in negatives], dual_per_query=dual_counts,
            doc_passages=doc_passages,
        )

    def _allowed(self, positives: list[list[int]], columns: list[int],
                 negatives_per_row: list[int]) -> torch.Tensor:
        """``[B, columns]``: each query's own positive (column i) and own hard negatives, and
        with in-batch negatives every other column except the query's positives."""
        size = len(positives)
        docs = np.asarray(columns, dtype=np.int64)
        if self.in_batch:
            owner = np.repeat(np.arange(size), [len(p) for p in positives])
            flat = np.fromiter((d for p in positives for d in p), np.int64, count=len(owner))
            is_positive = np.zeros((size, len(docs)), dtype=bool)
            rows, cols = np.nonzero(flat[:, None] == docs[None, :])
            is_positive[owner[rows], cols] = True
            allowed = ~is_positive
        else:
            allowed = np.zeros((size, len(docs)), dtype=bool)
        allowed[np.arange(size), np.arange(size)] = True
        own = np.repeat(np.arange(size), negatives_per_row)
        allowed[own, size + np.arange(len(own))] = True
        return torch.from_numpy(allowed)

    def _dual(self, qids: list[str], positives: list[int], dual: NegativesTable | None,
              per_positive: int) -> tuple[list[str], torch.Tensor | None, list[int]]:
        """DANCE Eq. 10: for positive d_i, its query q_i against negative queries near d_i.

        The dual table's rows are keyed by document index; its candidates stand for the query
        ids it carries (``candidate_query_ids``)."""
        if dual is None:
            return [], None, [0] * len(qids)
        if dual.candidate_query_ids is None:
            raise ValueError(f"the DANCE table of step {dual.step} names no candidate queries "
                             "(candidate_query_ids): it was written by an older version")
        drawn = dual.sample_many([str(doc) for doc in positives], per_positive, self.rng)
        names = dual.candidate_query_ids
        texts = [self.queries[str(names[c])] for picked in drawn for c in picked]
        allowed = torch.zeros(len(qids), len(qids) + len(texts), dtype=torch.bool)
        column = len(qids)
        for i, rows in enumerate(drawn):
            allowed[i, i] = True
            allowed[i, column: column + len(rows)] = True
            column += len(rows)
        return texts, allowed, [len(rows) for rows in drawn]

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state, "epoch_order": list(self.epoch_order),
                "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.epoch_order = list(state["epoch_order"])
        self.cursor = int(state["cursor"])
