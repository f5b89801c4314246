"""Tests of the training batch builder (src/ance_train/trainer/batches.py)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import torch

from ance_train.data.dataset import DatasetIndex
from ance_train.negatives.table import PAD, SOURCE_CODE, NegativesTable, uniform_probabilities
from ance_train.trainer.batches import BatchBuilder, TrainingBatch

# q1 and q2 share document 2 as a positive; q4 has two positives.
TRAIN = {
    "q0": {0: 1},
    "q1": {1: 1, 2: 1},
    "q2": {2: 2},
    "q3": {3: 1},
    "q4": {4: 1, 5: 1},
    "q5": {6: 1},
}
POSITIVES = {qid: set(docs) for qid, docs in TRAIN.items()}


def _dataset(train: dict[str, dict[int, int]] | None = None) -> DatasetIndex:
    train = TRAIN if train is None else train
    return DatasetIndex(
        format="beir",
        num_docs=30,
        queries={qid: f"text of {qid}" for qid in train},
        train=train,
    )


def _table() -> NegativesTable:
    """Hard negatives as the indexer writes them: the query's own positives removed.

    Rows deliberately hold positives of *other* queries (doc 2 for q0, doc 0 for q3,
    doc 5 for q5) and one short row (q2: three candidates and padding).
    """
    rows = {
        "q0": [2, 7, 8, 9, 10],
        "q1": [11, 12, 13, 0, 14],
        "q2": [15, 16, 17, PAD, PAD],
        "q3": [0, 18, 19, 20, 21],
        "q4": [22, 23, 6, 24, 25],
        "q5": [5, 26, 27, 28, 29],
    }
    qids = list(rows)
    candidates = np.array([rows[q] for q in qids], dtype=np.int64)
    return NegativesTable(
        step=3,
        query_ids=np.array(qids),
        candidates=candidates,
        scores=np.zeros(candidates.shape, np.float32),
        positive_scores=np.zeros(len(qids), np.float32),
        probabilities=uniform_probabilities(candidates),
        sources=np.where(candidates != PAD, SOURCE_CODE["ann"], -1).astype(np.int8),
    )


def _own_negative_columns(batch: TrainingBatch, counts: list[int]) -> list[list[int]]:
    """Columns of each query's hard negatives: they follow the B positives, query by query."""
    columns, start = [], len(batch.query_ids)
    for count in counts:
        columns.append(list(range(start, start + count)))
        start += count
    return columns


def _check_invariants(batch: TrainingBatch, negatives_per_query: int, in_batch: bool,
                      table: NegativesTable | None) -> None:
    b = len(batch.query_ids)
    assert len(set(batch.query_ids)) == b
    assert batch.query_texts == [f"text of {q}" for q in batch.query_ids]
    assert torch.equal(batch.positive_column, torch.arange(b))
    assert batch.allowed.shape == (b, len(batch.doc_indices))
    assert batch.allowed.dtype == torch.bool
    counts = []
    for qid in batch.query_ids:
        if table is None:
            counts.append(0)
        else:
            row = table.candidates[table.row(qid)]
            counts.append(min(negatives_per_query, int((row != PAD).sum())))
    assert batch.hard_negatives == sum(counts) == len(batch.doc_indices) - b
    own = _own_negative_columns(batch, counts)
    for i, qid in enumerate(batch.query_ids):
        positives = POSITIVES[qid]
        # Column i holds a positive of query i.
        assert batch.doc_indices[i] in positives
        assert batch.allowed[i, i]
        # Its hard negatives come from its own table row and are never its positives.
        negatives = [batch.doc_indices[c] for c in own[i]]
        assert len(set(negatives)) == len(negatives)
        assert PAD not in negatives
        assert not set(negatives) & positives
        if table is not None:
            assert set(negatives) <= set(table.candidates[table.row(qid)].tolist())
        for column, doc in enumerate(batch.doc_indices):
            allowed = bool(batch.allowed[i, column])
            if column != i and doc in positives:
                assert not allowed, (qid, column, doc)
            if in_batch:
                assert allowed == (column == i or doc not in positives), (qid, column, doc)
            else:
                assert allowed == (column == i or column in own[i]), (qid, column, doc)


def test_batches_with_hard_and_in_batch_negatives() -> None:
    table = _table()
    builder = BatchBuilder(_dataset(), batch_size=4, negatives_per_query=2,
                           in_batch_negatives=True, seed=0)
    for _ in range(30):
        batch = builder.build(table)
        assert len(batch.query_ids) == 4
        _check_invariants(batch, 2, in_batch=True, table=table)


def test_short_row_gives_fewer_negatives() -> None:
    table = _table()
    builder = BatchBuilder(_dataset(), batch_size=6, negatives_per_query=4,
                           in_batch_negatives=True, seed=5)
    batch = builder.build(table)
    _check_invariants(batch, 4, in_batch=True, table=table)
    assert batch.hard_negatives == 5 * 4 + 3  # q2's row has three candidates


def test_shared_positive_is_masked_for_both_queries() -> None:
    """q1 and q2 both have document 2 as a positive: neither may see it as a negative."""
    table = _table()
    builder = BatchBuilder(_dataset(), batch_size=6, negatives_per_query=3,
                           in_batch_negatives=True, seed=1)
    saw_q1_picking_doc2 = saw_q1_picking_doc1 = False
    for _ in range(20):
        batch = builder.build(table)  # every batch holds all six queries
        _check_invariants(batch, 3, in_batch=True, table=table)
        i1, i2 = batch.query_ids.index("q1"), batch.query_ids.index("q2")
        assert batch.doc_indices[i2] == 2
        assert not batch.allowed[i1, i2]  # q2's positive is q1's positive too
        # q0's hard negatives include document 2 whenever drawn: masked for q1 and q2.
        for column, doc in enumerate(batch.doc_indices):
            if doc == 2 and column not in (i1, i2):
                assert not batch.allowed[i1, column]
                assert not batch.allowed[i2, column]
        if batch.doc_indices[i1] == 2:
            saw_q1_picking_doc2 = True
            assert not batch.allowed[i2, i1]
        else:
            saw_q1_picking_doc1 = True
            assert batch.doc_indices[i1] == 1
            assert batch.allowed[i2, i1]  # doc 1 is a fine negative for q2
    assert saw_q1_picking_doc2 and saw_q1_picking_doc1


def test_without_in_batch_negatives_only_own_columns() -> None:
    table = _table()
    builder = BatchBuilder(_dataset(), batch_size=3, negatives_per_query=2,
                           in_batch_negatives=False, seed=2)
    for _ in range(20):
        batch = builder.build(table)
        _check_invariants(batch, 2, in_batch=False, table=table)
        assert batch.allowed.sum().item() == 3 * (1 + 2)


def test_without_table_only_in_batch_positives() -> None:
    builder = BatchBuilder(_dataset(), batch_size=4, negatives_per_query=2,
                           in_batch_negatives=True, seed=3)
    for _ in range(20):
        batch = builder.build(None)
        assert batch.hard_negatives == 0
        assert len(batch.doc_indices) == 4
        _check_invariants(batch, 2, in_batch=True, table=None)


def test_queries_without_positives_are_not_trained_and_batch_is_capped() -> None:
    train = {"q0": {0: 1}, "q1": {1: 1}, "qz": {}}
    dataset = DatasetIndex(format="beir", num_docs=5,
                           queries={"q0": "a", "q1": "b", "qz": "c"}, train=train)
    builder = BatchBuilder(dataset, batch_size=8, negatives_per_query=0,
                           in_batch_negatives=True, seed=0)
    batch = builder.build(None)
    assert sorted(batch.query_ids) == ["q0", "q1"]


def _picks(builder: BatchBuilder, batches: int) -> list[list[str]]:
    return [builder.build(None).query_ids for _ in range(batches)]


def test_epochs_cover_every_query_before_repeating() -> None:
    builder = BatchBuilder(_dataset(), batch_size=2, negatives_per_query=0,
                           in_batch_negatives=True, seed=7)
    batches = _picks(builder, 3 * 4)  # four epochs of three batches
    for epoch in range(4):
        flat = [q for batch in batches[3 * epoch: 3 * epoch + 3] for q in batch]
        assert sorted(flat) == sorted(TRAIN)
    # Epochs are shuffled differently (12 orders of 6 queries would all match by chance
    # with probability (1/720)^3).
    orders = {tuple(q for batch in batches[3 * e: 3 * e + 3] for q in batch) for e in range(4)}
    assert len(orders) > 1


def test_first_epoch_is_a_permutation_when_batch_does_not_divide() -> None:
    builder = BatchBuilder(_dataset(), batch_size=4, negatives_per_query=0,
                           in_batch_negatives=True, seed=11)
    flat = [q for batch in _picks(builder, 3) for q in batch]
    assert sorted(flat[:6]) == sorted(TRAIN)


def test_counts_stay_balanced_when_batch_does_not_divide() -> None:
    """Epoch by epoch, no query is drawn a second time more than once ahead of another.

    With 6 queries and batches of 4 a batch straddles each epoch boundary; a query that
    was in the first half of such a batch must still get its turn in the next epoch.
    """
    for seed in range(5):
        builder = BatchBuilder(_dataset(), batch_size=4, negatives_per_query=0,
                               in_batch_negatives=True, seed=seed)
        counts: Counter[str] = Counter()
        for number, batch in enumerate(_picks(builder, 30), start=1):
            counts.update(batch)
            values = [counts[q] for q in TRAIN]
            assert max(values) - min(values) <= 1, (seed, number, dict(counts))


def test_state_dict_reproduces_next_batch() -> None:
    table = _table()
    original = BatchBuilder(_dataset(), batch_size=4, negatives_per_query=2,
                            in_batch_negatives=True, seed=21)
    for _ in range(2):  # the next batch straddles the end of the first epoch
        original.build(table)
    # The trainer stores the state as JSON inside its checkpoint.
    state = json.loads(json.dumps(original.state_dict()))
    expected = [original.build(table) for _ in range(3)]

    restored = BatchBuilder(_dataset(), batch_size=4, negatives_per_query=2,
                            in_batch_negatives=True, seed=999)
    restored.load_state_dict(state)
    for want in expected:
        got = restored.build(table)
        assert got.query_ids == want.query_ids
        assert got.doc_indices == want.doc_indices
        assert torch.equal(got.allowed, want.allowed)
        assert torch.equal(got.positive_column, want.positive_column)
        assert got.hard_negatives == want.hard_negatives
