"""``dev/ance_train_dev/stored_run.py`` rebuilds a kept checkpoint's index as the indexer built it.

``bench/significance.py`` refuses a report whose test nDCG@10 the rebuilt ranking does not
reproduce; a rebuild that scores documents even one ulp differently from the indexer can swap
two near-tied documents in a query's top 10 (it did, on a cpu-long SimANS run).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ance_train.config import IndexConfig
from ance_train.data.dataset import DatasetIndex
from ance_train.indexer.build import ShardedBuild
from ance_train.protocol import keys
from ance_train.protocol.embeddings import pack_embeddings


def test_a_stored_checkpoint_scores_exactly_as_the_indexer_did(monkeypatch,
                                                                tmp_path: Path) -> None:
    from ance_train_dev.stored_run import load_checkpoint

    rng = np.random.default_rng(0)
    docs, dim, shard_size, step = 1000, 32, 300, 20
    # What a cosine model stores: unit vectors in float32, normalised once in the model.
    corpus = rng.standard_normal((docs, dim)).astype(np.float32)
    corpus /= np.linalg.norm(corpus, axis=1, keepdims=True)
    queries = rng.standard_normal((40, dim)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    qids = [f"q{i:02d}" for i in range(len(queries))]
    dataset = DatasetIndex(format="beir", num_docs=docs,
                           queries={q: q for q in qids},
                           train={q: {i: 1} for i, q in enumerate(qids[:30])},
                           test={q: {i: 1} for i, q in enumerate(qids[30:])})
    store = tmp_path / "store" / "run"
    (store / keys.DATASET_INDEX).parent.mkdir(parents=True, exist_ok=True)
    (store / keys.DATASET_INDEX).write_text(dataset.to_json())
    shards = store / keys.embeddings(step)
    shards.mkdir(parents=True)
    starts = list(range(0, docs, shard_size))
    build = ShardedBuild(step, list(range(len(starts))), docs, IndexConfig(type="flat"))
    for shard, start in enumerate(starts):
        ids = np.arange(start, min(start + shard_size, docs))
        (shards / f"corpus-{shard:05d}.npz").write_bytes(pack_embeddings(ids, corpus[ids]))
        build.add(ids, corpus[ids])
    (shards / "queries-00000.npz").write_bytes(pack_embeddings(np.array(qids), queries))

    indexed = build.finish(dim)
    stored = load_checkpoint(store, step)
    want_ids, want_scores = indexed.search(queries, 100, 1024)
    got_ids, got_scores = stored.index.search(stored.query_vectors(qids), 100, 1024)
    np.testing.assert_array_equal(got_ids, want_ids)
    # Bit for bit: normalising the stored unit vectors again (as a cosine AnnIndex does)
    # moves some scores in their last bits.
    np.testing.assert_array_equal(got_scores, want_scores)
