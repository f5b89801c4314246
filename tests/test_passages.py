"""Units of MaxP (``data.passages.mode: max``, ANCE arXiv:2007.00808 §5): the passage
splitter on a real tokenizer, document scores by the best passage against a brute-force
reference (real FAISS, exact ties), partitions and the merged view over a real local store,
mining over passages, the shard format, the config checks and the trainer's use of the
chosen passages.

Vectors have small integer entries, so every inner product is exact in FAISS (with or
without BLAS), in numpy and in float16 storage, and tied scores are frequent: rankings are
compared id for id, ties included.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from ance_train.config import (
    ConfigError,
    DataConfig,
    IndexConfig,
    NegativesConfig,
    PassagesConfig,
    load_config,
)
from ance_train.data.corpus import Corpus, open_corpus
from ance_train.data.dataset import DatasetIndex
from ance_train.data.validation import validate_dataset
from ance_train.index.ann import AnnIndex
from ance_train.index.merge import merge_topk
from ance_train.index.passages import PassageIndex, collapse_to_documents
from ance_train.indexer.partitions import MergedIndex
from ance_train.infra.store import LocalStore
from ance_train.modeling.encoding import tokenize_texts
from ance_train.modeling.model import load_tokenizer, tokenize
from ance_train.modeling.passages import PassageSplitter
from ance_train.negatives.mining import Miner
from ance_train.negatives.table import PAD, SOURCE_CODE, NegativesTable, uniform_probabilities
from ance_train.protocol.embeddings import (
    documents_of,
    pack_embeddings,
    passage_keys,
    stored_dtype,
    unpack_embeddings,
    unpack_passages,
    unpack_rows,
)
from ance_train.protocol.work import RefreshPlan, ShardKind
from ance_train.trainer.batches import BatchBuilder, TrainingBatch
from ance_train.trainer.distributed import shard_batch
from ance_train.trainer.prefetch import BatchPreparer, PlannedBatch

from ance_train_dev.helpers import write_config

M = 4      # max_passages of the synthetic corpus
DIM = 8
DOCS = 200
PROMPT = "passage: "
MAXP = PassagesConfig(mode="max", max_passages=4)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    return load_tokenizer(tiny_model)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, scifact_subset: Path) -> Corpus:
    data = DataConfig(path=str(scifact_subset))
    cache = tmp_path_factory.mktemp("passages-cache")
    validate_dataset(data, cache, seed=0)
    opened = open_corpus(data, cache)
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def texts(corpus: Corpus) -> list[str]:
    return corpus.texts(list(range(120)))


# --------------------------------------------------------------------------- a. the splitter


def _token_count(tokenizer, text: str, prompt: str = PROMPT) -> int:
    return len(tokenize(tokenizer, [text], prompt)["input_ids"][0])


@pytest.mark.parametrize(("config", "length"), [
    (MAXP, 32),
    (PassagesConfig(mode="max", max_passages=64), 32),  # every passage of long texts
    (PassagesConfig(mode="max", max_passages=64, length=24), 64),  # length over the doc cap
])
def test_passages_cover_the_text_in_order_within_the_length(
        tokenizer, texts: list[str], config: PassagesConfig, length: int) -> None:
    splitter = PassageSplitter(tokenizer, config, length, PROMPT)
    assert splitter.length == (config.length or length)
    spans = splitter.spans(texts)
    assert len(spans) == len(texts)
    several = 0
    for text, text_spans in zip(texts, spans, strict=True):
        assert 1 <= len(text_spans) <= config.max_passages
        several += len(text_spans) > 1
        assert text[:text_spans[0][0]].strip() == "", "nothing before the first passage"
        for (start, end), (next_start, next_end) in itertools.pairwise(text_spans):
            assert next_start > start and next_end > end, "passages in text order"
            # Non-overlapping windows: only white space between one passage and the next.
            assert next_start <= end or text[end:next_start].strip() == "", (text, start, end)
        for start, end in text_spans:
            assert 0 <= start < end <= len(text)
            assert _token_count(tokenizer, text[start:end]) <= splitter.length, \
                (text[start:end], _token_count(tokenizer, text[start:end]))
        if len(text_spans) < config.max_passages:  # not capped: the whole text is covered
            assert text[text_spans[-1][1]:].strip() == ""
    assert several > len(texts) // 2, "SciFact abstracts are longer than one passage"
    # split and passage give the same substrings.
    split = splitter.split(texts)
    assert split.texts == [text[s:e] for text, ts in zip(texts, spans, strict=True)
                           for s, e in ts]
    assert split.documents.tolist() == [i for i, ts in enumerate(spans) for _ in ts]
    assert split.passages.tolist() == [p for ts in spans for p in range(len(ts))]
    assert split.passages.dtype == np.int16
    numbers = [(i * 7) % len(ts) for i, ts in enumerate(spans)]
    assert splitter.passage(texts, numbers) == [
        text[ts[n][0]:ts[n][1]] for text, ts, n in zip(texts, spans, numbers, strict=True)]


def test_capped_passages_and_numbers_past_the_last(tokenizer, texts: list[str]) -> None:
    capped = PassageSplitter(tokenizer, PassagesConfig(mode="max", max_passages=2), 32, PROMPT)
    every = PassageSplitter(tokenizer, PassagesConfig(mode="max", max_passages=64), 32, PROMPT)
    for capped_spans, every_spans in zip(capped.spans(texts), every.spans(texts), strict=True):
        assert capped_spans == every_spans[:2], "the cap keeps the first passages"
    long_text = next(t for t, s in zip(texts, every.spans(texts), strict=True) if len(s) > 3)
    last = every.spans([long_text])[0][-1]
    assert every.passage([long_text], [63]) == [long_text[last[0]:last[1]]]
    assert capped.passage([long_text], [5]) == capped.passage([long_text], [1])


def test_a_text_of_one_passage_is_encoded_as_firstp(tokenizer, texts: list[str]) -> None:
    splitter = PassageSplitter(tokenizer, MAXP, 32, PROMPT)
    window = splitter.window
    assert window == 32 - 2 - len(tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
    long_text = next(t for t in texts if _token_count(tokenizer, t, "") > 3 * window)
    offsets = tokenizer(long_text, add_special_tokens=False,
                        return_offsets_mapping=True)["offset_mapping"]
    exact = long_text[:offsets[window - 1][1]]  # exactly one window of tokens
    one_more = long_text[:offsets[window][1]]
    short = ["what causes a fever?", exact, "", "   "]
    spans = splitter.spans(short)
    assert spans == [[(0, len(text))] for text in short]
    assert splitter.split(short).texts == short
    assert tokenize_texts(tokenizer, splitter.split(short).texts, 32, PROMPT) == \
        tokenize_texts(tokenizer, short, 32, PROMPT)
    assert len(splitter.spans([one_more])[0]) == 2


def test_a_shorter_stride_overlaps_passages(tokenizer, texts: list[str]) -> None:
    config = PassagesConfig(mode="max", max_passages=6, stride=10)
    splitter = PassageSplitter(tokenizer, config, 32, PROMPT)
    assert splitter.stride == 10 < splitter.window
    overlapped = 0
    for text, spans in zip(texts, splitter.spans(texts), strict=True):
        for (start, end), (next_start, _) in itertools.pairwise(spans):
            assert start < next_start < end, "each passage starts inside the previous one"
            overlapped += 1
        for start, end in spans:
            assert _token_count(tokenizer, text[start:end]) <= splitter.length
    assert overlapped > 50


def test_passages_start_at_word_starts_and_long_words_are_cut(tokenizer) -> None:
    """A passage begins at the start of a word (the rest of a word, tokenised on its own,
    takes more tokens than its window held); a word longer than the stride is cut."""
    text = "the compound " + "xq" * 45 + " was tested in mice and rats."
    word = text.index("xq")
    for stride in (None, 10):
        config = PassagesConfig(mode="max", max_passages=64, stride=stride)
        splitter = PassageSplitter(tokenizer, config, 16)
        spans = splitter.spans([text])[0]
        assert spans[0][0] == 0 and spans[1][0] == word, spans
        assert all(b[0] > a[0] for a, b in itertools.pairwise(spans))
        assert spans[-1][1] == len(text)
        for start, end in spans:
            assert _token_count(tokenizer, text[start:end], "") <= 16
    words = ("Approximately twelve hundred hospitalizations " * 30).strip()
    splitter = PassageSplitter(tokenizer, PassagesConfig(mode="max", max_passages=64), 16)
    for start, _ in splitter.spans([words])[0]:
        assert start == 0 or words[start - 1] == " ", words[start:start + 20]


def test_impossible_splits_are_refused(tokenizer) -> None:
    long_prompt = "represent this scientific document for retrieval: "
    with pytest.raises(ValueError, match=r"data\.passages\.length 8 leaves no room"):
        PassageSplitter(tokenizer, PassagesConfig(mode="max", length=8), 32, long_prompt)
    with pytest.raises(ValueError, match=r"data\.passages\.stride 31 skips text"):
        PassageSplitter(tokenizer, PassagesConfig(mode="max", stride=31), 32)
    PassageSplitter(tokenizer, PassagesConfig(mode="max", stride=30), 32)  # window: 30


# --------------------------------------------------------------------------- b. MaxP scoring


@dataclass
class Passages:
    """A synthetic corpus of passages: row i is passage ``number[i]`` of document
    ``doc[i]`` (documents in order, passages in order)."""

    counts: np.ndarray
    doc: np.ndarray
    number: np.ndarray
    vectors: np.ndarray

    @property
    def keys(self) -> np.ndarray:
        return passage_keys(self.doc, self.number, M)

    def of(self, docs: np.ndarray) -> np.ndarray:
        return np.isin(self.doc, docs)


def _passages(seed: int = 0) -> Passages:
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, M + 1, size=DOCS)
    doc = np.repeat(np.arange(DOCS), counts)
    number = np.concatenate([np.arange(c) for c in counts])
    vectors = rng.integers(-3, 4, size=(len(doc), DIM)).astype(np.float32)
    vectors[doc == 150] = vectors[0]        # duplicates across documents
    vectors[np.flatnonzero(doc == 7)[:1]] = vectors[0]
    multi = np.flatnonzero(counts >= 3)[:5]  # and within a document
    for d in multi:
        rows = np.flatnonzero(doc == d)
        vectors[rows[2]] = vectors[rows[1]]
    return Passages(counts, doc, number, vectors)


def _queries(passages: Passages, count: int = 40, seed: int = 1) -> np.ndarray:
    queries = np.random.default_rng(seed).integers(-3, 4, size=(count, DIM)).astype(np.float32)
    queries[:3] = passages.vectors[0]
    return queries


def _index(passages: Passages, mask: np.ndarray | None = None) -> AnnIndex:
    mask = np.ones(len(passages.doc), bool) if mask is None else mask
    index = AnnIndex(DIM, IndexConfig(device="cpu"), expected_size=int(mask.sum()))
    rows = np.flatnonzero(mask)
    half = len(rows) // 2
    for part in (rows[:half], rows[half:]):  # added in two pieces, as shards come
        index.add(passages.keys[part], passages.vectors[part])
    index.finalize()
    return index


@dataclass
class Brute:
    scores: np.ndarray   # [Q, D] MaxP score of each document (float64, exact)
    best: np.ndarray     # [Q, D] lowest-numbered passage with that score

    def ranking(self, row: int) -> np.ndarray:
        """Documents by score descending, then document ascending."""
        return np.lexsort((np.arange(self.scores.shape[1]), -self.scores[row]))

    def search(self, k: int, passages: int) -> tuple[np.ndarray, np.ndarray]:
        width = min(k, passages)
        ids = np.full((len(self.scores), width), PAD, np.int64)
        scores = np.zeros((len(self.scores), width), np.float32)
        for row in range(len(self.scores)):
            top = self.ranking(row)[:width]
            ids[row, :len(top)] = top
            scores[row, :len(top)] = self.scores[row, top]
        return ids, scores


def _brute(passages: Passages, queries: np.ndarray) -> Brute:
    sims = queries.astype(np.float64) @ passages.vectors.astype(np.float64).T
    slots = np.full((len(queries), DOCS, M), -np.inf)
    slots[:, passages.doc, passages.number] = sims
    return Brute(slots.max(axis=2), np.argmax(slots, axis=2))


def test_collapse_to_documents_by_hand() -> None:
    # Keys (M = 4): 9 = doc 2 passage 1, 8 = doc 2 passage 0, 1 = doc 0 passage 1.
    keys = np.array([[9, 8, 1, 14, -1], [1, -1, -1, -1, -1]])
    scores = np.array([[5.0, 4.0, 4.0, 3.0, 0.0], [2.0, 0, 0, 0, 0]], np.float32)
    docs, best, numbers = collapse_to_documents(keys, scores, 3, M)
    assert docs.tolist() == [[2, 0, 3], [0, -1, -1]]
    assert best.tolist() == [[5.0, 4.0, 3.0], [2.0, 0.0, 0.0]]
    assert numbers.tolist() == [[1, 1, 2], [1, 0, 0]]
    assert documents_of(keys, M).tolist()[0] == [2, 2, 0, 3, -1]


@pytest.mark.parametrize("k", [1, 5, 37, 199, 200, 260])
def test_maxp_search_equals_brute_force(k: int) -> None:
    passages = _passages()
    queries = _queries(passages)
    index = PassageIndex(_index(passages), M, DOCS)
    assert len(index) == DOCS and index.dim == DIM
    ids, scores = index.search(queries, k, batch_size=25)  # a BLAS batch and a smaller one
    want_ids, want_scores = _brute(passages, queries).search(k, len(passages.doc))
    assert ids.shape == want_ids.shape
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(scores, want_scores, rtol=0, atol=1e-5)
    for row in ids:  # every document once per list
        real = row[row >= 0]
        assert len(set(real.tolist())) == len(real)
    if k >= DOCS:
        assert (ids[:, :DOCS] >= 0).all() and (ids[:, DOCS:] == PAD).all()


def test_maxp_scores_best_passages_and_vectors_equal_brute_force() -> None:
    passages = _passages()
    queries = _queries(passages)
    brute = _brute(passages, queries)
    index = PassageIndex(_index(passages), M, DOCS)
    rng = np.random.default_rng(2)
    docs = rng.integers(0, DOCS, size=(len(queries), 30))
    docs[:, 0] = 150  # a duplicate of document 0's passage
    want = np.take_along_axis(brute.scores, docs, axis=1)
    np.testing.assert_allclose(index.scores(queries, docs), want, rtol=0, atol=1e-5)
    best = index.best_passages(queries, docs)
    np.testing.assert_array_equal(best, np.take_along_axis(brute.best, docs, axis=1))
    assert (best < passages.counts[docs]).all(), "a passage the document has"
    assert (best > 0).any() and len(np.unique(best)) == M, "the test sees every passage number"
    # Ties within a document go to the lower number: the duplicated passage 2 never wins.
    tied = np.flatnonzero(passages.counts >= 3)[:5]
    tied_best = index.best_passages(queries, np.broadcast_to(tied, (len(queries), 5)))
    assert not (tied_best == 2).any()
    padded = docs.copy()
    padded[:, -1] = PAD
    assert (index.best_passages(queries, padded)[:, -1] == 0).all()
    chosen = docs[:, 3]
    vectors = index.best_vectors(queries, chosen)
    rows = np.array([np.flatnonzero((passages.doc == d) & (passages.number == p))[0]
                     for d, p in zip(chosen, brute.best[np.arange(len(chosen)), chosen],
                                     strict=True)])
    np.testing.assert_array_equal(vectors, passages.vectors[rows])
    # keys_of: every passage the index holds of the documents.
    assert index.keys_of(np.array([3, 0])).tolist() == sorted(
        passages.keys[passages.doc == 3].tolist()) + sorted(
        passages.keys[passages.doc == 0].tolist())


# --------------------------------------------------------------------------- c. partitions


def _plan(shard_size: int = 30) -> RefreshPlan:
    ranges = tuple((s, min(s + shard_size, DOCS)) for s in range(0, DOCS, shard_size))
    return RefreshPlan(step=3, corpus_ranges=ranges, query_ranges=((0, 40),))


@pytest.mark.parametrize("k", [1, 6, 50, 120, 200])
def test_partitions_of_passages_merge_to_one_index(k: int) -> None:
    passages = _passages()
    queries = _queries(passages)
    plan = _plan()
    single = PassageIndex(_index(passages), M, DOCS).search(queries, k, batch_size=25)
    lists = []
    for partition in range(2):
        owned = np.concatenate([np.arange(*plan.corpus_ranges[s])
                                for s in plan.owned_shards(partition, 2)])
        part = PassageIndex(_index(passages, passages.of(owned)), M, len(owned))
        ids, _ = found = part.search(queries, k, batch_size=25)
        assert set(ids[ids >= 0].tolist()) <= set(owned.tolist())
        lists.append(found)
    ids, scores = merge_topk(lists, k)
    np.testing.assert_array_equal(ids, single[0])
    np.testing.assert_array_equal(scores, single[1])


def _stored(tmp_path: Path, passages: Passages, plan: RefreshPlan) -> LocalStore:
    store = LocalStore("run", tmp_path)
    for work in plan.work(ShardKind.CORPUS):
        rows = (passages.doc >= work.start) & (passages.doc < work.stop)
        store.put_bytes(work.key, pack_embeddings(passages.doc[rows], passages.vectors[rows],
                                                  "float16", passages=passages.number[rows]))
    return store


def test_merged_view_over_stored_passage_shards_answers_as_one_index(tmp_path: Path) -> None:
    passages = _passages()
    queries = _queries(passages)
    plan = _plan()
    store = _stored(tmp_path, passages, plan)
    one = PassageIndex(_index(passages), M, DOCS)
    rows = MergedIndex(store, plan, DIM, cache_shards=2, max_passages=M)
    view = PassageIndex(rows, M, plan.num_docs)
    for k in (1, 64, 200):
        got, want = view.search(queries, k, batch_size=25), one.search(queries, k, batch_size=25)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    docs = np.random.default_rng(5).integers(0, DOCS, size=(len(queries), 12))
    np.testing.assert_array_equal(view.scores(queries, docs), one.scores(queries, docs))
    np.testing.assert_array_equal(view.best_passages(queries, docs),
                                  one.best_passages(queries, docs))
    np.testing.assert_array_equal(view.best_vectors(queries, docs[:, 0]),
                                  one.best_vectors(queries, docs[:, 0]))
    assert view.keys_of(np.array([0, 199])).tolist() == one.keys_of(np.array([0, 199])).tolist()
    # The positives' passages as the partitions send them (every passage of each, by key).
    sent = one.keys_of(np.array([4, 100, 150]))
    known = PassageIndex(MergedIndex(store, plan, DIM, known=(sent, one.rows.vectors(sent)),
                                     max_passages=M), M, plan.num_docs)
    np.testing.assert_array_equal(known.rows.vectors(sent), one.rows.vectors(sent))
    assert known.rows.shards_read == 0
    np.testing.assert_array_equal(known.best_passages(queries, docs),
                                  one.best_passages(queries, docs))
    # A whole-document shard where passages are indexed is refused.
    store.put_bytes(plan.work(ShardKind.CORPUS)[0].key,
                    pack_embeddings(np.arange(30), np.zeros((30, DIM), np.float32)))
    with pytest.raises(ValueError, match="whole documents"):
        MergedIndex(store, plan, DIM, max_passages=M).vectors(np.array([0]))


# --------------------------------------------------------------------------- d. mining


@dataclass
class MiningWorld:
    passages: Passages
    queries: np.ndarray
    brute: Brute
    train_ids: list[str]
    positives: list[set[int]]
    dataset: DatasetIndex
    index: PassageIndex


def _mining_world() -> MiningWorld:
    passages = _passages(seed=3)
    queries = _queries(passages, count=30, seed=4)
    brute = _brute(passages, queries)
    rng = np.random.default_rng(6)
    qids = [f"q{i}" for i in range(len(queries))]  # "q10" sorts before "q2"
    train: dict[str, dict[int, int]] = {}
    for row, qid in enumerate(qids):
        near = brute.ranking(row)
        chosen = {int(near[0]), int(near[2])}  # among the nearest: removing them matters
        if row % 3 == 0:
            chosen.add(int(rng.integers(DOCS)))
        train[qid] = dict.fromkeys(chosen, 1)
    train_ids = sorted(train)
    order = [qids.index(q) for q in train_ids]
    queries = queries[order]
    dataset = DatasetIndex(format="beir", num_docs=DOCS,
                           queries={q: f"text of {q}" for q in qids}, train=train)
    return MiningWorld(passages, queries, _brute(passages, queries), train_ids,
                       [set(train[q]) for q in train_ids], dataset,
                       PassageIndex(_index(passages), M, DOCS))


def _mine(world: MiningWorld, config: NegativesConfig, step: int,
          previous: NegativesTable | None = None) -> tuple[Miner, NegativesTable]:
    miner = Miner(config, 0.5, world.dataset, world.train_ids, seed=3)
    ranked, sims = world.index.search(world.queries, max(100, miner.depth())
                                      + miner.max_positives)
    return miner, miner.mine(step, world.index, world.queries, ranked, sims, previous)


def _check_table(world: MiningWorld, table: NegativesTable) -> None:
    brute = world.brute
    valid = table.candidates != PAD
    assert valid.sum() > len(world.train_ids) * 5
    for row, positives in enumerate(world.positives):
        assert not set(table.candidates[row][valid[row]].tolist()) & positives, row
    safe = np.where(valid, table.candidates, 0)
    # The passage of each candidate: one it has, the best for the row's query.
    assert table.passages is not None and table.passages.dtype == np.int8
    assert table.passages.shape == table.candidates.shape
    want = np.where(valid, np.take_along_axis(brute.best, safe, axis=1), 0)
    np.testing.assert_array_equal(table.passages, want)
    assert (table.passages < world.passages.counts[safe]).all()
    assert (table.passages[valid] > 0).any(), "some negative is trained on a later passage"
    # Scores are MaxP scores (over the temperature 0.5).
    np.testing.assert_allclose(table.scores[valid],
                               2 * np.take_along_axis(brute.scores, safe, axis=1)[valid],
                               rtol=0, atol=1e-4)
    # Positives: every one of the row's, with its best passage.
    assert table.positive_docs is not None and table.positive_passages is not None
    assert table.positive_docs.dtype == np.int64 and table.positive_passages.dtype == np.int8
    width = max(len(p) for p in world.positives)
    assert table.positive_docs.shape == (len(world.train_ids), width)
    for row, positives in enumerate(world.positives):
        docs = table.positive_docs[row]
        assert sorted(docs[docs != PAD].tolist()) == sorted(positives)
        assert (docs[len(positives):] == PAD).all()
        for column, doc in enumerate(docs.tolist()):
            expected = 0 if doc == PAD else brute.best[row, doc]
            assert table.positive_passages[row, column] == expected, (row, doc)
        # The positive score is that of one positive's best passage.
        assert any(abs(table.positive_scores[row] - 2 * brute.scores[row, d]) < 1e-4
                   for d in positives)


def _without_positives(brute: Brute, row: int, positives: set[int], k: int) -> list[int]:
    return [d for d in brute.ranking(row).tolist() if d not in positives][:k]


@pytest.mark.parametrize("sampling", ["uniform", "simans"])
def test_ann_mining_over_passages_matches_brute_force(sampling: str) -> None:
    world = _mining_world()
    config = (NegativesConfig(pool="ann", sampling="uniform", top_k=12) if sampling == "uniform"
              else NegativesConfig(pool="ann", sampling="simans", simans={"top_k": 12}))
    miner, table = _mine(world, config, 3)
    assert miner.depth() == 12
    _check_table(world, table)
    for row, positives in enumerate(world.positives):
        assert table.candidates[row].tolist() == _without_positives(world.brute, row,
                                                                    positives, 12)
    if sampling == "simans":
        assert not np.allclose(table.probabilities, table.probabilities[:, :1])


def test_tele_mining_over_passages_uses_the_best_passage_for_lookahead() -> None:
    world = _mining_world()
    config = NegativesConfig(pool="tele", sampling="uniform", top_k=10,
                             tele={"max_candidates": 40})
    _, first = _mine(world, config, 0)
    _check_table(world, first)
    _, table = _mine(world, config, 3, previous=first)
    _check_table(world, table)
    sources = set(table.sources[table.candidates != PAD].tolist())
    assert sources == {SOURCE_CODE[s] for s in ("ann", "momentum", "lookahead")}, sources
    # Lookahead: neighbours of one positive's best passage (d̃⁺ as the query scores it).
    lookahead_rows = 0
    for row, positives in enumerate(world.positives):
        found = set(table.candidates[row][table.sources[row] == SOURCE_CODE["lookahead"]]
                    .tolist())
        if not found:
            continue
        lookahead_rows += 1
        possible = []
        for doc in positives:
            vector = world.index.best_vectors(world.queries[row:row + 1], np.array([doc]))
            near = _brute(world.passages, vector)
            possible.append(set(_without_positives(near, 0, positives, 10)))
        assert any(found <= p for p in possible), row
    assert lookahead_rows > len(world.positives) // 2


def test_table_with_passages_round_trips_and_names_passages(tmp_path: Path) -> None:
    world = _mining_world()
    _, table = _mine(world, NegativesConfig(pool="ann", top_k=12), 3)
    table.write(tmp_path / "table.npz")
    for back in (NegativesTable.from_bytes(table.to_bytes()),
                 NegativesTable.open(tmp_path / "table.npz")):
        for name in ("candidates", "passages", "positive_docs", "positive_passages"):
            np.testing.assert_array_equal(getattr(back, name), getattr(table, name))
            assert getattr(back, name).dtype == getattr(table, name).dtype, name
        for row, qid in enumerate(world.train_ids):
            for doc in world.positives[row]:
                assert back.passage_of(qid, doc) == world.brute.best[row, doc]
            for doc in table.candidates[row][table.candidates[row] != PAD].tolist():
                assert back.passage_of(qid, doc) == world.brute.best[row, doc]
            named = set(table.candidates[row].tolist()) | world.positives[row]
            unknown = next(d for d in np.argsort(-world.brute.best[row]).tolist()
                           if d not in named)
            assert world.brute.best[row, unknown] > 0
            assert back.passage_of(qid, unknown) == 0
        assert back.passage_of("no such query", int(table.candidates[0, 0])) == 0
    plain = NegativesTable.from_bytes(NegativesTable(
        step=1, query_ids=table.query_ids, candidates=table.candidates, scores=table.scores,
        positive_scores=table.positive_scores, probabilities=table.probabilities,
        sources=table.sources).to_bytes())
    assert plain.passages is None and plain.positive_docs is None
    assert plain.passage_of(world.train_ids[0], int(table.candidates[0, 1])) == 0


# --------------------------------------------------------------------------- e. shards


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_passage_shards_round_trip(dtype: str) -> None:
    rng = np.random.default_rng(8)
    ids = np.repeat(np.arange(100, 110), [1, 3, 2, 3, 1, 1, 2, 3, 3, 1])
    numbers = np.concatenate([np.arange(c) for c in [1, 3, 2, 3, 1, 1, 2, 3, 3, 1]])
    vectors = rng.standard_normal((len(ids), 6)).astype(np.float32)
    data = pack_embeddings(ids, vectors, dtype, passages=numbers)  # type: ignore[arg-type]
    assert stored_dtype(data) == np.dtype(dtype)
    back_ids, back_vectors = unpack_embeddings(data)
    assert back_ids.tolist() == ids.tolist()
    np.testing.assert_array_equal(back_vectors, vectors.astype(dtype).astype(np.float32))
    assert unpack_passages(data).tolist() == numbers.tolist()
    keys, rows = unpack_rows(data, 3)
    assert keys.tolist() == (ids * 3 + numbers).tolist()
    assert documents_of(keys, 3).tolist() == ids.tolist()
    np.testing.assert_array_equal(rows, back_vectors)
    assert np.all(np.diff(keys) > 0), "keys keep the corpus order"
    with pytest.raises(ValueError, match="MaxP shard"):
        unpack_rows(data, None)
    with pytest.raises(ValueError, match=r"passage numbers must lie in \[0, 2\)"):
        unpack_rows(data, 2)
    plain = pack_embeddings(ids, vectors, dtype)  # type: ignore[arg-type]
    assert unpack_passages(plain) is None
    assert unpack_rows(plain, None)[0].tolist() == ids.tolist()
    with pytest.raises(ValueError, match="whole documents"):
        unpack_rows(plain, 3)
    with pytest.raises(ValueError, match="passage numbers for"):
        pack_embeddings(ids, vectors, dtype, passages=numbers[:-1])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- f. config


def _config(tmp_path: Path, **sections: dict):
    data = tmp_path / "dataset"
    data.mkdir(exist_ok=True)
    base: dict = {"data": {"path": str(data)}}
    for name, section in sections.items():
        base[name] = {**base.get(name, {}), **section}
    return load_config(write_config(tmp_path / "run.yaml", **base))


def test_passages_config_defaults_and_refusals(tmp_path: Path) -> None:
    default = _config(tmp_path)
    assert default.data.passages.mode == "first" and not default.data.passages.enabled
    assert default.data.passages.max_passages == 4
    assert default.data.passages.length is None and default.data.passages.stride is None
    maxp = _config(tmp_path, data={"passages": {"mode": "max", "max_passages": 3}})
    assert maxp.data.passages.enabled and maxp.data.passages.max_passages == 3
    dance = {"model": {"similarity": "cosine"}, "negatives": {"dance": {"dual_weight": 0.1}}}
    assert _config(tmp_path, **dance).negatives.dance.dual_weight == 0.1  # FirstP: fine
    with pytest.raises(ConfigError, match=r"dual_weight > 0 .* FirstP only"):
        _config(tmp_path, data={"passages": {"mode": "max"}}, **dance)
    assert _config(tmp_path, data={"passages": {"mode": "max"}}, model={"similarity": "cosine"},
                   negatives={"dance": {"dual_weight": 0.0}}).data.passages.enabled
    with pytest.raises(ConfigError, match=r"stride \(17\) is longer than a passage \(16"):
        _config(tmp_path, data={"passages": {"mode": "max", "length": 16, "stride": 17}})
    with pytest.raises(ConfigError, match=r"stride \(33\) is longer than a passage \(32"):
        _config(tmp_path, data={"passages": {"mode": "max", "stride": 33}},
                model={"max_doc_length": 32})
    with pytest.raises(ConfigError, match="max_passages"):
        _config(tmp_path, data={"passages": {"mode": "max", "max_passages": 0}})
    with pytest.raises(ConfigError, match="mode"):
        _config(tmp_path, data={"passages": {"mode": "sum"}})


# --------------------------------------------------------------------------- g. trainer


TRAIN = {"q0": {0: 1}, "q1": {1: 1, 2: 1}, "q2": {2: 2}, "q3": {3: 1}, "q4": {4: 1, 5: 1},
         "q5": {6: 1}}


def _passage_table() -> NegativesTable:
    """Rows hold other queries' positives (doc 2 for q0, 0 for q3), so a document's passage
    depends on whose column it is."""
    rows = {"q0": [2, 7, 8, 9], "q1": [11, 12, 0, PAD], "q2": [15, 16, 17, 1],
            "q3": [0, 18, 19, 20], "q4": [22, 23, 6, 24], "q5": [5, 26, 27, 28]}
    qids = list(rows)
    candidates = np.array([rows[q] for q in qids], dtype=np.int64)
    positives = np.array([[0, PAD], [1, 2], [2, PAD], [3, PAD], [4, 5], [6, PAD]], np.int64)
    shape = candidates.shape
    return NegativesTable(
        step=3, query_ids=np.array(qids), candidates=candidates,
        scores=np.zeros(shape, np.float32), positive_scores=np.zeros(len(qids), np.float32),
        probabilities=uniform_probabilities(candidates),
        sources=np.where(candidates != PAD, SOURCE_CODE["ann"], -1).astype(np.int8),
        passages=((np.arange(shape[0])[:, None] + np.arange(shape[1])) % 3 + 1
                  ).astype(np.int8) * (candidates != PAD),
        positive_docs=positives,
        positive_passages=(np.array([[2, 0], [3, 1], [1, 0], [2, 0], [1, 3], [3, 0]])
                           ).astype(np.int8))


def _expected_passage(table: NegativesTable, qid: str, doc: int) -> int:
    row = table.row(qid)
    positives = table.positive_docs[row].tolist()
    if doc in positives:
        return int(table.positive_passages[row, positives.index(doc)])
    candidates = table.candidates[row].tolist()
    return int(table.passages[row, candidates.index(doc)]) if doc in candidates else 0


def test_batches_carry_the_passage_of_each_column() -> None:
    table = _passage_table()
    dataset = DatasetIndex(format="beir", num_docs=30,
                           queries={q: f"text of {q}" for q in TRAIN}, train=TRAIN)
    builder = BatchBuilder(dataset, batch_size=4, negatives_per_query=2,
                           in_batch_negatives=True, seed=0)
    non_first = 0
    for _ in range(20):
        batch = builder.build(table, passages=table)
        owners = batch.query_ids + [q for q, n in zip(batch.query_ids, batch.negatives_per_query,
                                                      strict=True) for _ in range(n)]
        assert len(batch.doc_passages) == len(batch.doc_indices) == len(owners)
        assert batch.doc_passages == [_expected_passage(table, q, d)
                                      for q, d in zip(owners, batch.doc_indices, strict=True)]
        assert batch.doc_passages == [table.passage_of(q, d)
                                      for q, d in zip(owners, batch.doc_indices, strict=True)]
        non_first += sum(p > 0 for p in batch.doc_passages)
        # Two ranks: each slice pairs its documents with their passages.
        pairs = []
        for rank in range(2):
            shard = shard_batch(batch, rank, 2)
            assert len(shard.doc_passages) == len(shard.doc_indices)
            pairs += list(zip(shard.doc_indices, shard.doc_passages, strict=True))
            positive_columns = shard.rows
            assert shard.doc_passages[:len(positive_columns)] == [
                batch.doc_passages[c] for c in positive_columns]
        assert sorted(pairs) == sorted(zip(batch.doc_indices, batch.doc_passages, strict=True))
    assert non_first > 40
    assert builder.build(table).doc_passages == []  # FirstP: no passages
    plain = NegativesTable(step=1, query_ids=table.query_ids, candidates=table.candidates,
                           scores=table.scores, positive_scores=table.positive_scores,
                           probabilities=table.probabilities, sources=table.sources)
    assert builder.build(table, passages=plain).doc_passages == []
    assert shard_batch(builder.build(table), 1, 2).doc_passages == []


def test_preparer_tokenises_the_chosen_passage(tokenizer, corpus: Corpus) -> None:
    config = PassagesConfig(mode="max", max_passages=3, length=24)
    splitter = PassageSplitter(tokenizer, config, 32, PROMPT)
    texts = corpus.texts(list(range(60)))
    long_docs = [d for d, spans in enumerate(splitter.spans(texts)) if len(spans) == 3][:6]
    assert len(long_docs) == 6
    doc_indices = long_docs
    doc_passages = [2, 1, 0, 1, 2, 2]  # two queries, each: a positive and two negatives
    batch = TrainingBatch(
        query_ids=["a", "b"], query_texts=["fever causes", "bone loss"],
        doc_indices=doc_indices, positive_column=torch.arange(2),
        allowed=torch.ones((2, 6), dtype=torch.bool), hard_negatives=4,
        dual_query_texts=[], dual_allowed=None, negatives_per_query=[2, 2],
        doc_passages=doc_passages)
    for rank, world in ((0, 1), (0, 2), (1, 2)):
        preparer = BatchPreparer(tokenizer, corpus, 16, 32, rank=rank, world_size=world,
                                 background=False, document_prompt=PROMPT, passages=splitter)
        assert preparer.max_doc_length == 24
        inputs = preparer.prepare(PlannedBatch(step=1, batch=batch, table_step=0, mined_at=0,
                                               negatives_ms=0.0))
        shard = inputs.shard
        chosen = splitter.passage(corpus.texts(shard.doc_indices), shard.doc_passages)
        want = tokenize(tokenizer, chosen, PROMPT, padding=True, truncation=True,
                        max_length=24, return_tensors="pt")
        assert torch.equal(inputs.doc_ids, want["input_ids"])
        assert torch.equal(inputs.doc_mask, want["attention_mask"])
        first = tokenize(tokenizer, splitter.passage(corpus.texts(shard.doc_indices),
                                                     [0] * len(shard.doc_indices)),
                         PROMPT, padding=True, truncation=True, max_length=24,
                         return_tensors="pt")
        assert not torch.equal(inputs.doc_ids, first["input_ids"]), "not the first passages"
    # Without doc_passages (no table names a passage): the first passage of each.
    batch.doc_passages = []
    preparer = BatchPreparer(tokenizer, corpus, 16, 32, background=False,
                             document_prompt=PROMPT, passages=splitter)
    inputs = preparer.prepare(PlannedBatch(step=1, batch=batch, table_step=None, mined_at=None,
                                           negatives_ms=0.0))
    first = tokenize(tokenizer, splitter.passage(corpus.texts(doc_indices), [0] * 6), PROMPT,
                     padding=True, truncation=True, max_length=24, return_tensors="pt")
    assert torch.equal(inputs.doc_ids, first["input_ids"])
