"""The vectorised refresh path against the per-row code it replaced (issue 15, item 6).

Every function runs next to its old per-row implementation (``dev/ance_train_dev/
mining_reference.py``, ``reference_*``) on seeded random inputs built to hit the corners:
duplicate documents within a row and across parts, positives among the candidates, rows of
PAD only, short rows, PAD in the middle of a row, probability ties, query ids missing from
or repeated in the previous table. Results must be equal to the last bit (``assert_array_equal``
on floats, no tolerance). Then the table's storage: :meth:`NegativesTable.open` memory-maps
the same arrays ``from_bytes`` reads, for tables written today and by the old writer.
"""

from __future__ import annotations

import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest

from ance_train.indexer.diagnostics import Diagnostics, reciprocal_ranks
from ance_train.infra.store.local import LocalStore
from ance_train.negatives.mining import align_rows, draw_anchors, first_seen
from ance_train.negatives.rows import Positives, lookup_rows, rowwise_lookup
from ance_train.negatives.strategies.ance import keep_previous_rows, merge_remined
from ance_train.negatives.strategies.dance import dual_query_negatives
from ance_train.negatives.strategies.tele import mix_rows
from ance_train.negatives.table import (
    PAD,
    NegativesTable,
    overlap_at,
    remove_positives,
    store_table,
)
from ance_train.protocol.tables import TableId
from ance_train.trainer.negatives_feed import NegativesFeed

from ance_train_dev.mining_reference import (
    reference_align_rows,
    reference_anchors,
    reference_composition,
    reference_dual_rows,
    reference_first_seen,
    reference_keep_previous_rows,
    reference_merge_remined,
    reference_mix_rows,
    reference_overlap_at,
    reference_owners,
    reference_reciprocal_ranks,
    reference_remove_positives,
)

SEEDS = range(6)
FIELDS = ("candidates", "scores", "probabilities", "sources", "first_seen")


# --------------------------------------------------------------------------- random inputs


def _ranked(rng: np.random.Generator, rows: int, width: int, docs: int) -> np.ndarray:
    """Candidate rows over a few documents (duplicates), with PAD tails (short rows), PAD
    in the middle, and rows of PAD only."""
    ranked = rng.integers(0, docs, size=(rows, width)).astype(np.int64)
    lengths = rng.integers(0, width + 1, size=rows)
    ranked[np.arange(width)[None, :] >= lengths[:, None]] = PAD
    ranked[rng.random((rows, width)) < 0.05] = PAD
    ranked[rng.random(rows) < 0.1] = PAD
    return ranked


def _positives(rng: np.random.Generator, ranked: np.ndarray, docs: int,
               many: bool = False) -> list[set[int]]:
    """Per row: none, a few of its own candidates and a few others (or many: > 8)."""
    out = []
    for row in ranked:
        count = int(rng.integers(9, 20)) if many else int(rng.integers(0, 4))
        own = [int(d) for d in row if d != PAD]
        chosen = set(rng.choice(own, size=min(count // 2 + 1, len(own)), replace=False)
                     .tolist()) if own and count else set()
        chosen |= set(rng.integers(0, docs, size=count - len(chosen)).tolist()) if count else set()
        out.append(chosen)
    return out


def _table(rng: np.random.Generator, query_ids: list[str], width: int, docs: int,
           step: int) -> NegativesTable:
    """A table with ties in its probabilities, repeated documents and its own first_seen."""
    candidates = _ranked(rng, len(query_ids), width, docs)
    valid = candidates != PAD
    probabilities = np.where(valid, rng.choice([0.1, 0.2, 0.25], size=candidates.shape),
                             0.0).astype(np.float32)
    return NegativesTable(
        step=step, query_ids=np.array(query_ids), candidates=candidates,
        scores=rng.normal(size=candidates.shape).astype(np.float32),
        positive_scores=rng.normal(size=len(query_ids)).astype(np.float32),
        probabilities=probabilities,
        sources=np.where(valid, rng.integers(0, 5, size=candidates.shape), -1).astype(np.int8),
        first_seen=np.where(valid, rng.integers(0, step + 1, size=candidates.shape), PAD))


def _query_ids(rng: np.random.Generator, count: int) -> tuple[list[str], list[str]]:
    """This refresh's query ids and a previous table's: shuffled, some missing, one repeated."""
    new = [f"q{i}" for i in range(count)]
    previous = [q for q in rng.permutation(new).tolist() if rng.random() > 0.15]
    previous += [f"gone{i}" for i in range(3)] + [previous[0]]
    return new, previous


def _assert_tables_equal(got: NegativesTable, expected: NegativesTable) -> None:
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(got, name), getattr(expected, name), err_msg=name)
        assert getattr(got, name).dtype == getattr(expected, name).dtype, name
    np.testing.assert_array_equal(got.query_ids, expected.query_ids)


# --------------------------------------------------------------------------- row operations


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("many", [False, True])
def test_remove_positives_matches_the_per_row_code(seed: int, many: bool) -> None:
    rng = np.random.default_rng(seed)
    ranked = _ranked(rng, 300, 40, docs=60)
    scores = rng.normal(size=ranked.shape).astype(np.float32)
    positives = _positives(rng, ranked, 60, many)
    for keep in (0, 1, 7, 40, 55):
        expected = reference_remove_positives(ranked, scores, positives, keep)
        for given in (positives, Positives.from_rows(positives)):
            got = remove_positives(ranked, scores, given, keep)
            for g, e in zip(got, expected, strict=True):
                np.testing.assert_array_equal(g, e)
                assert g.dtype == e.dtype


@pytest.mark.parametrize("seed", SEEDS)
def test_overlap_align_first_seen_match_the_per_row_code(seed: int) -> None:
    rng = np.random.default_rng(seed)
    new_ids, old_ids = _query_ids(rng, 250)
    previous = _table(rng, old_ids, 30, docs=50, step=4)
    candidates = _ranked(rng, len(new_ids), 25, docs=50)
    top = _ranked(rng, len(new_ids), 12, docs=50)
    assert overlap_at(candidates, top) == reference_overlap_at(candidates, top)
    for got, expected in zip(align_rows(previous, new_ids),
                             reference_align_rows(previous, new_ids), strict=True):
        np.testing.assert_array_equal(got, expected)
        assert got.dtype == expected.dtype
    expected = reference_first_seen(candidates, 9, previous, new_ids)
    np.testing.assert_array_equal(first_seen(candidates, 9, previous, new_ids), expected)
    assert (expected < 9).any() and (expected == 9).any()  # both carried and fresh cells
    np.testing.assert_array_equal(first_seen(candidates, 9, None, new_ids),
                                  reference_first_seen(candidates, 9, None, new_ids))


def test_row_lookup_of_sorted_distinct_ids_skips_the_sort() -> None:
    """The indexer's query ids are sorted and distinct: ``rows_of`` then needs no sort and
    must still find what ``row`` finds."""
    rng = np.random.default_rng(11)
    new_ids, _ = _query_ids(rng, 300)
    previous = _table(rng, sorted(set(new_ids[5:]) | {"zz"}), 12, docs=40, step=2)
    expected = [previous.row(q) for q in new_ids]
    assert previous.rows_of(new_ids).tolist() == [-1 if r is None else r for r in expected]
    assert np.array_equal(previous._sorted, np.arange(len(previous)))
    for got, want in zip(align_rows(previous, new_ids),
                         reference_align_rows(previous, new_ids), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("widths", [(20, 20), (20, 30), (30, 20)])
def test_partial_remining_matches_the_per_row_code(seed: int, widths: tuple[int, int]) -> None:
    rng = np.random.default_rng(seed)
    new_ids, old_ids = _query_ids(rng, 200)
    previous = _table(rng, old_ids, widths[0], docs=80, step=3)
    fresh = _table(rng, new_ids, widths[1], docs=80, step=6)
    remined = keep_previous_rows(fresh, previous, 0.5, np.random.default_rng(seed))
    expected_mask = reference_keep_previous_rows(fresh, previous, 0.5,
                                                 np.random.default_rng(seed))
    np.testing.assert_array_equal(remined, expected_mask)
    assert remined.any() and not remined.all()
    got, expected = _copy(fresh), _copy(fresh)
    merge_remined(got, previous, remined)
    reference_merge_remined(expected, previous, remined)
    _assert_tables_equal(got, expected)


def _copy(table: NegativesTable) -> NegativesTable:
    return NegativesTable.from_bytes(table.to_bytes())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cap", [1, 5, 40, 200])
def test_mix_rows_matches_the_per_row_code(seed: int, cap: int) -> None:
    rng = np.random.default_rng(seed)
    rows = 150
    parts = []
    for code, weight, width in ((0, 1.0, 30), (3, 0.5, 45), (4, 0.5, 30), (2, 0.0, 10)):
        candidates = _ranked(rng, rows, width, docs=60)
        candidates[0] = PAD  # a row of PAD in every part
        candidates[1 + code] = PAD  # rows empty in one part only
        raw = rng.choice([1.0, 2.0, 2.0, 3.0], size=candidates.shape)  # ties
        raw = np.where(candidates != PAD, raw, 0.0)
        total = raw.sum(axis=1, keepdims=True)
        probabilities = np.divide(raw, total, out=np.zeros_like(raw), where=total > 0)
        dtype = np.float32 if code != 3 else np.float64
        parts.append((candidates, probabilities.astype(dtype), code, weight))
    expected = reference_mix_rows(parts, cap)
    got = mix_rows(parts, cap)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_array_equal(g, e)
        assert g.dtype == e.dtype
    assert (expected[0][0] == PAD).all() and (expected[0][2:4] != PAD).any()
    assert mix_rows(parts[3:], cap)[0].tolist() == reference_mix_rows(parts[3:], cap)[0].tolist()


def test_mix_rows_sums_repeats_in_the_order_met() -> None:
    """Float addition is not associative: a document met three times gets
    ``((0 + a) + b) + c`` as the old running sum did, not a pairwise sum."""
    a, b, c = 0.1, 0.2, 0.3
    parts = [(np.array([[7, 7]]), np.array([[a, b]]), 0, 1.0),
             (np.array([[7, 8]]), np.array([[c, 1.0]]), 3, 1.0)]
    ids, probs, sources = mix_rows(parts, 2)
    mass = ((0.0 + a) + b) + c
    assert ids.tolist() == [[8, 7]] and sources.tolist() == [[3, 0]]
    np.testing.assert_array_equal(probs, np.array([[1.0 / (1.0 + mass), mass / (1.0 + mass)]],
                                                  dtype=np.float32))
    np.testing.assert_array_equal(probs, reference_mix_rows(parts, 2)[1])


@pytest.mark.parametrize("seed", SEEDS)
def test_anchors_dual_rows_and_diagnostics_match_the_per_row_code(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ranked = _ranked(rng, 200, 30, docs=90)
    positives = [p or {int(rng.integers(90))} for p in _positives(rng, ranked, 90)]
    csr = Positives.from_rows(positives)
    # Anchors: the same draws and the generator left in the same state.
    old_rng, new_rng = np.random.default_rng([seed, 5]), np.random.default_rng([seed, 5])
    np.testing.assert_array_equal(draw_anchors(csr, new_rng),
                                  reference_anchors([sorted(p) for p in positives], old_rng))
    assert new_rng.random() == old_rng.random()
    # DANCE: owners of each positive document, the rows and exclusions of its table.
    owners = reference_owners(positives)
    owned, transposed = csr.owners()
    docs = sorted(owners)
    np.testing.assert_array_equal(owned, docs)
    for i, doc in enumerate(docs):
        assert transposed.row(i).tolist() == sorted(owners[doc])
    row_ids, excluded = reference_dual_rows(docs, owners)
    queries = _ranked(rng, len(docs), 25, docs=len(positives))
    scores = rng.normal(size=queries.shape).astype(np.float32)
    names = [f"q{i}" for i in range(len(positives))]
    for given in (owners, transposed):
        table = dual_query_negatives(docs, queries, scores, given, 10, 3, names)
        np.testing.assert_array_equal(table.query_ids, row_ids)
        assert table.query_ids.dtype == row_ids.dtype
        expected_ids, expected_scores = reference_remove_positives(queries, scores, excluded, 10)
        np.testing.assert_array_equal(table.candidates, expected_ids)
        np.testing.assert_array_equal(table.scores, expected_scores)
    # Diagnostics: MRR of the sample and the composition by first step.
    np.testing.assert_array_equal(reciprocal_ranks(ranked, positives),
                                  reference_reciprocal_ranks(ranked, positives))
    np.testing.assert_array_equal(reciprocal_ranks(ranked, positives, depth=3),
                                  reference_reciprocal_ranks(ranked, positives, depth=3))
    table = _table(rng, [f"q{i}" for i in range(200)], 20, docs=90, step=7)
    ids = table.query_ids.tolist()
    diagnostics = Diagnostics(ids, positives, seed=1).compute(ranked, None, table)
    assert diagnostics["composition_by_first_seen"] == reference_composition(table)


def test_row_helpers_on_corners() -> None:
    keys = np.array([[5, 3, 5, PAD], [PAD, PAD, PAD, PAD], [1, 2, 3, 4]])
    values = np.array([[5, PAD, 3, 9], [PAD, 1, 1, 1], [4, 4, 0, 1]])
    assert rowwise_lookup(values, keys).tolist() == [[2, -1, 1, -1], [-1, -1, -1, -1],
                                                     [3, 3, -1, 0]]
    ids = np.array(["b", "a", "c", "a"])
    assert lookup_rows(ids, ["a", "c", "z", "b"]).tolist() == [3, 2, -1, 0]
    assert lookup_rows(ids[:0], ["a"]).tolist() == [-1]
    csr = Positives.from_rows([{3, 1}, [], [2, 2, 0]])
    assert csr.indptr.tolist() == [0, 2, 2, 4] and csr.indices.tolist() == [1, 3, 0, 2]
    assert csr.dense(slice(None)).tolist() == [[1, 3], [PAD, PAD], [0, 2]]
    assert csr.take(np.array([2, 0])).indices.tolist() == [0, 2, 1, 3]
    docs, owners = Positives.from_rows([{3, 1}, [], [3, 0]]).owners()
    assert docs.tolist() == [0, 1, 3] and owners.indptr.tolist() == [0, 1, 2, 4]
    assert owners.indices.tolist() == [2, 0, 0, 2]
    with pytest.raises(ValueError, match="2 ranked rows, 2 score rows, 3 rows of positives"):
        remove_positives(np.zeros((2, 3), np.int64), np.zeros((2, 3)), csr, 2)


# --------------------------------------------------------------------------- storage


def _legacy_bytes(table: NegativesTable) -> bytes:
    """A table as the first writer stored it: no first_seen, no candidate_query_ids."""
    import io

    buffer = io.BytesIO()
    np.savez(buffer, step=np.int64(table.step), query_ids=table.query_ids.astype(str),
             candidates=table.candidates, scores=table.scores,
             positive_scores=table.positive_scores, probabilities=table.probabilities,
             sources=table.sources)
    return buffer.getvalue()


def test_open_memory_maps_what_from_bytes_reads(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    table = _table(rng, [f"q{i}" for i in range(400)], 37, docs=500, step=12)
    table.candidate_query_ids = np.array(["x", "yy"])
    path = tmp_path / "12.npz"
    table.write(path)
    assert path.read_bytes()[:4] == b"PK\x03\x04"
    with zipfile.ZipFile(path) as archive:  # uncompressed members: what lets them be mapped
        assert {i.compress_type for i in archive.infolist()} == {zipfile.ZIP_STORED}
    opened, loaded = NegativesTable.open(path), NegativesTable.from_bytes(path.read_bytes())
    _assert_tables_equal(opened, loaded)
    _assert_tables_equal(opened, table)
    assert opened.step == 12 and opened.candidate_query_ids.tolist() == ["x", "yy"]
    for name in FIELDS:
        array = getattr(opened, name)
        assert isinstance(array.base, np.memmap), name
        assert not array.flags.writeable, name
    draws = ["q5", "q300", "missing", "q0"]
    assert (opened.sample_many(draws, 4, np.random.default_rng(1))
            == table.sample_many(draws, 4, np.random.default_rng(1)))

    # A table stored by the first writer, and one compressed by hand, read the same way.
    legacy = tmp_path / "legacy.npz"
    legacy.write_bytes(_legacy_bytes(table))
    old = NegativesTable.open(legacy)
    np.testing.assert_array_equal(old.first_seen, np.where(table.candidates != PAD, 12, PAD))
    assert old.candidate_query_ids is None and isinstance(old.candidates.base, np.memmap)
    compressed = tmp_path / "compressed.npz"
    with np.load(path) as arrays:
        np.savez_compressed(compressed, **dict(arrays))
    _assert_tables_equal(NegativesTable.open(compressed), table)

    broken = tmp_path / "broken.npz"
    broken.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(ValueError, match=r"broken\.npz: not a readable negatives table"):
        NegativesTable.open(broken)


def test_store_table_streams_through_a_scratch_file(tmp_path: Path) -> None:
    table = _table(np.random.default_rng(4), [f"q{i}" for i in range(30)], 6, docs=50, step=1)
    store = LocalStore("tables", tmp_path / "store")
    scratch = tmp_path / "scratch"
    sha = store_table(store, TableId.ann(1).key, table, scratch)
    assert len(sha) == 64
    _assert_tables_equal(NegativesTable.from_bytes(store.get_bytes(TableId.ann(1).key)), table)
    assert list(scratch.iterdir()) == [], "the scratch file is removed"


class _NoEvents:
    """The feed's bus, for a feed whose tables are handed to it directly (``_handle``)."""

    def history(self, event_type: type) -> list:
        return []


def test_feed_maps_tables_from_its_cache_and_deletes_replaced_files(tmp_path: Path) -> None:
    from ance_train.protocol.events import NegativesReady

    store = LocalStore("feed", tmp_path / "store")
    rng = np.random.default_rng(0)
    ids = [f"q{i}" for i in range(50)]
    tables = {step: _table(rng, ids, 8, docs=100, step=step) for step in (2, 5)}
    for step, table in tables.items():
        store.put_bytes(TableId.ann(step).key, table.to_bytes())
    cache = tmp_path / "work"
    stale = cache / TableId.ann(1).key  # left by a process that stopped
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old")
    feed = NegativesFeed(_NoEvents(), store, "trainer", threading.Event(),  # type: ignore[arg-type]
                         cache_dir=cache)
    assert not stale.exists(), "a previous process's copies are removed at start"
    feed._handle(NegativesReady(tables=(TableId.ann(2),)))
    assert feed.ann is not None and isinstance(feed.ann.candidates.base, np.memmap)
    _assert_tables_equal(feed.ann, tables[2])
    first = cache / TableId.ann(2).key
    assert first.exists()
    held = feed.ann
    feed._handle(NegativesReady(tables=(TableId.ann(5),)))
    _assert_tables_equal(feed.ann, tables[5])
    assert not first.exists() and (cache / TableId.ann(5).key).exists()
    _assert_tables_equal(held, tables[2])  # still readable while the loop holds it
